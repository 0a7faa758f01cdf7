"""SGLang's shard naming, as hicache_mp namespaces. Imports neither SGLang nor torch.

Owns the one rule shared by the SGLang backend (`backend`) and the
store importer (`store_import`): which SGLang ranks share pages and
which must never see each other's, following SGLang's `HiCacheFile` key
suffix (0.5.23, `mem_cache/hicache_storage.py`):

    model   = "-".join(model_name.split("/"))
    shard   = f"_{pp_size}_{pp_rank}"           if pp_size > 1
            + f"_cp{cp_rank}_{cp_size}"         if attn_cp_size > 1
    suffix  = f"_{model}{shard}"                        MLA (KV replicated over TP)
            = f"_{model}_{tp_rank}_{tp_size}{shard}"    otherwise
            + f"_tp{tp_size}_dcp{dcp_rank}_{dcp_size}_page{logical_page_size}"  if dcp_size > 1

An SGLang `file` store names a page `<key><suffix>.bin`. hicache_mp puts the
same facts into `EngineConfig.model_name / tp_rank / tp_size / namespace_extra`
(MLA ranks all use tp 0 of 1, so they share pages), with two differences
(decision 91): the model name is kept as it is, not with '/' turned into
'-' (`acme/llama-8b` and `acme-llama/8b` stay apart), and the weights'
identity (common.identity, computed by the caller) joins the namespace, so
two models served from one path never share pages. Must not open files.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class SGLangShard:
    model_name: str | None
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    is_mla: bool = False
    dcp_rank: int = 0
    dcp_size: int = 1
    logical_page_size: int | None = None
    identity: str = ""      # common.identity.model_identity: the weights behind model_name

    @classmethod
    def from_storage_config(cls, cfg, identity: str = "") -> "SGLangShard":
        """From an SGLang `HiCacheStorageConfig` of any version (missing fields: defaults)."""
        def get(name, default):
            value = getattr(cfg, name, default)
            return default if value is None else value
        return cls(model_name=getattr(cfg, "model_name", None),
                   tp_rank=get("tp_rank", 0), tp_size=get("tp_size", 1),
                   pp_rank=get("pp_rank", 0), pp_size=get("pp_size", 1),
                   attn_cp_rank=get("attn_cp_rank", 0), attn_cp_size=get("attn_cp_size", 1),
                   is_mla=bool(get("is_mla_model", False)),
                   dcp_rank=get("dcp_rank", 0), dcp_size=get("dcp_size", 1),
                   logical_page_size=getattr(cfg, "logical_page_size", None),
                   identity=identity)

    @property
    def model(self) -> str:
        return "-".join(self.model_name.split("/")) if self.model_name else ""

    @property
    def shard_suffix(self) -> str:
        s = f"_{self.pp_size}_{self.pp_rank}" if self.pp_size > 1 else ""
        if self.attn_cp_size > 1:
            s += f"_cp{self.attn_cp_rank}_{self.attn_cp_size}"
        return s

    @property
    def dcp_suffix(self) -> str:
        if self.dcp_size > 1:
            return (f"_tp{self.tp_size}_dcp{self.dcp_rank}_{self.dcp_size}"
                    f"_page{self.logical_page_size}")
        return ""

    @property
    def file_suffix(self) -> str:
        """What SGLang's `file` backend appends to a KV page key (before `.bin`)."""
        if self.is_mla:
            base = f"_{self.model}{self.shard_suffix}"
        else:
            base = f"_{self.model}_{self.tp_rank}_{self.tp_size}{self.shard_suffix}"
        return base + self.dcp_suffix

    def engine_names(self) -> dict:
        """EngineConfig fields: model_name, tp_rank, tp_size, namespace_extra."""
        tp_rank, tp_size = (0, 1) if self.is_mla else (self.tp_rank, self.tp_size)
        extra = "sglang" + self.shard_suffix + self.dcp_suffix
        if self.identity:
            extra += "|id=" + self.identity
        return {"model_name": self.model_name or "default", "tp_rank": tp_rank,
                "tp_size": tp_size, "namespace_extra": extra}
