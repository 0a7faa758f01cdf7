"""What identifies a model's weights in the key namespace (decision 91).

Owns one rule for every adapter: two servers share pages only when they
serve the same weights, whatever path or name they give them. A framework's
model name is often a path that many models share (`--model-path /model` in
containers), so the namespace also holds:

- for a local directory: a hash of its config.json and a cheap fingerprint
  of its weight files (each *.safetensors, *.bin, *.pt, *.pth, *.gguf: name,
  size and the first, middle and last 64 KiB; never a whole file);
- for a local weight file: the same fingerprint of that file;
- for a hub id (no such path here): the id and its revision;
- the served model name and weight version where the framework sets them.

An explicit namespace (the `namespace` key of the extra config) replaces all
of it: the operator then says which servers share pages. Must not open
anything but the model's config and weight files, and never read more than
3 x 64 KiB of one file.
"""
import hashlib
import os

SAMPLE = 64 << 10
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
CONFIG_NAME = "config.json"


def quote(part: str) -> str:
    """`part` with '%' and '|' escaped: fields joined by '|' stay apart, so the
    joined string names one tuple of fields (an injective encoding)."""
    return part.replace("%", "%25").replace("|", "%7C")


def _file_sample(h, path: str, size: int) -> None:
    """First, middle and last SAMPLE bytes of a file into hash `h`."""
    with open(path, "rb") as f:
        for at in sorted({0, max(0, size // 2 - SAMPLE // 2), max(0, size - SAMPLE)}):
            f.seek(at)
            h.update(f.read(SAMPLE))


def weights_fingerprint(path: str) -> str:
    """Hex digest of a model directory's config and weight files (or of one
    weight file): names, sizes and sampled content."""
    h = hashlib.sha256()
    if os.path.isfile(path):
        files = [path]
        root = os.path.dirname(path)
    else:
        root = path
        files = []
        for d, dirs, names in os.walk(path):
            dirs.sort()
            files += [os.path.join(d, n) for n in sorted(names)
                      if n.endswith(WEIGHT_SUFFIXES) or (d == path and n == CONFIG_NAME)]
    for f in files:
        size = os.path.getsize(f)
        h.update(f"{os.path.relpath(f, root)}\0{size}\0".encode())
        if os.path.basename(f) == CONFIG_NAME:
            with open(f, "rb") as c:   # the whole config: small, and what it says matters
                h.update(hashlib.sha256(c.read()).digest())
        else:
            _file_sample(h, f, size)
    return h.hexdigest()


def model_identity(model: str | None, *, revision: str | None = None,
                   served_name: str | None = None, weight_version: str | None = None,
                   namespace: str | None = None) -> str:
    """The identity string for the key namespace (fields quoted and joined by '|')."""
    if namespace:
        return "ns=" + quote(str(namespace))
    parts = []
    if model and os.path.exists(model):
        parts.append("weights=" + weights_fingerprint(model)[:32])
    elif model:
        parts.append("hub=" + quote(model) + "@" + quote(revision or ""))
    if served_name:
        parts.append("served=" + quote(str(served_name)))
    if weight_version:
        parts.append("wv=" + quote(str(weight_version)))
    return "|".join(parts)
