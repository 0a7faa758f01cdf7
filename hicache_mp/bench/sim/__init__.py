"""Reference engine: a scheduler modelled on SGLang's, its workload and its summary."""
