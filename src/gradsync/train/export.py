"""``gradsync export RUN --format safetensors|torch|hf DIR``: the trained model, out of a run.

The checkpoint is verified as a resume verifies it (``unit.read_unit``: every byte
of ``checkpoint.pt`` and of its shard directory, and every file read as data only,
:mod:`gradsync.safeload`) before anything is read; a damaged or crafted one is
refused in one line. The model is rebuilt from the run's
``config.json`` spec (``--model``: a built-in name or ``pkg.module:factory``; the
export's own ``--model`` overrides it, for a run trained from Python with a model
object), the trained weights are loaded into it (``export_weights``: fp32 masters
where the run kept them, consolidated from ZeRO shards), and written:

* ``safetensors``: ``DIR/model.safetensors`` by ``safetensors.torch.save_model``,
  which stores a tied weight once (a plain ``save_file`` refuses shared tensors);
  load with ``safetensors.torch.load_model(model, path)``;
* ``torch``: ``DIR/model.pt``, the state dict (``model.load_state_dict(torch.load(path))``);
* ``hf``: ``model.save_pretrained(DIR)`` (config.json + model.safetensors), for a
  transformers ``PreTrainedModel``; ``AutoModel*.from_pretrained(DIR)`` loads it.
  Any other model is refused, suggesting ``--format safetensors``.

``DIR/gradsync-export.json`` says where the weights came from (run, run id, step,
strategy, precision, which weights). Files are replaced atomically; ``DIR`` may
already exist (an earlier export is overwritten).
"""

from __future__ import annotations

import io
import os
from dataclasses import asdict, dataclass

import torch
from torch import nn

from ..errors import UsageError
from ..factory import is_factory_spec, load_factory
from ..models import MODELS, build_model
from ..rundir import CHECKPOINT, TMP_PREFIX, write_bytes, write_json
from ..safeload import trusting
from .checkpoint import load_checkpoint, read_header
from .export_weights import load_trained

FORMATS = ("safetensors", "torch", "hf")
FILES = {"safetensors": "model.safetensors", "torch": "model.pt"}
PROVENANCE = "gradsync-export.json"
SAFETENSORS_PIP = "pip install 'gradsync[export]' (or pip install safetensors)"


@dataclass
class Exported:
    run: str
    run_id: str | None
    step: int
    format: str
    model: str
    strategy: str
    precision: str
    weights: str  # which weights: the model state, or the fp32 masters (and from where)
    files: list[str]


def build_model_of(spec: str, config: dict) -> nn.Module:
    """The run's model, freshly built (seeded as the run was), to load the weights into."""
    torch.manual_seed(int(config.get("seed") or 0))
    if is_factory_spec(spec):
        model = load_factory(spec)()
        if not isinstance(model, nn.Module):
            raise UsageError(f"model factory {spec} returned {type(model).__name__}, not a "
                             "torch.nn.Module")
        return model
    if spec not in MODELS:
        raise UsageError(f"the run's model {spec!r} cannot be rebuilt: pass --model "
                         f"pkg.module:factory (or one of {', '.join(MODELS)})")
    return build_model("gpt", seq_len=int(config.get("seq_len") or 128)) if spec == "gpt" \
        else build_model(spec)


def is_transformers_model(model: nn.Module) -> bool:
    """A transformers ``PreTrainedModel`` (transformers is imported only if the model's
    class comes from it, or from a subclass of one of its classes)."""
    names = {c.__module__.split(".")[0] for c in type(model).__mro__}
    if "transformers" not in names:
        return False
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def _save_safetensors(model: nn.Module, path: str, metadata: dict) -> None:
    try:
        from safetensors.torch import save_model
    except ImportError:
        raise UsageError(f"--format safetensors needs the safetensors package: "
                         f"{SAFETENSORS_PIP}") from None
    tmp = os.path.join(os.path.dirname(path), f"{TMP_PREFIX}{os.getpid()}-model.safetensors")
    try:
        save_model(model, tmp, metadata={k: str(v) for k, v in metadata.items()})
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _write(model: nn.Module, fmt: str, dest: str, meta: dict) -> list[str]:
    if fmt == "hf":
        model.save_pretrained(dest)  # config.json, model.safetensors (tied weights once)
        return sorted(f for f in os.listdir(dest) if f != PROVENANCE)
    path = os.path.join(dest, FILES[fmt])
    if fmt == "safetensors":
        _save_safetensors(model, path, meta)
    else:
        buf = io.BytesIO()
        torch.save(model.state_dict(), buf)
        write_bytes(path, buf.getvalue(), "the exported model")
    return [FILES[fmt]]


def export_run(run_dir: str, fmt: str, dest: str, model: str | None = None,
               trust_code: bool = False) -> Exported:
    """Write the trained model of ``run_dir``'s checkpoint to ``dest`` in format ``fmt``
    (``trust_code``: ``--trust-checkpoint-code``, the user's opt-in to full unpickling)."""
    if fmt not in FORMATS:
        raise UsageError(f"unknown --format {fmt!r}; choose from {', '.join(FORMATS)}")
    path = os.path.join(run_dir, CHECKPOINT)
    if not os.path.isdir(run_dir):
        raise UsageError(f"{run_dir} is not a run directory")
    with trusting(trust_code):  # data only, unless the user opted in
        header = read_header(path)  # every byte of the unit verified, or one line saying why not
        if header is None:
            raise UsageError(f"{run_dir} holds no checkpoint ({CHECKPOINT}): nothing to export")
        state = load_checkpoint(path, verified=False)
    config = state.get("config") or {}
    spec = model or config.get("model") or ""
    if os.path.exists(dest) and not os.path.isdir(dest):
        raise UsageError(f"{dest} exists and is not a directory")
    module = build_model_of(spec, config)
    if fmt == "hf" and not is_transformers_model(module):  # before anything is written
        raise UsageError(f"--format hf needs a transformers PreTrainedModel; the run's model "
                         f"is a {type(module).__name__}: use --format safetensors")
    with trusting(trust_code):
        weights = load_trained(module, state, run_dir, spec)
    module.eval()
    os.makedirs(dest, exist_ok=True)
    result = Exported(run=os.path.abspath(run_dir), run_id=header.get("run_id"),
                      step=int(header["step"]), format=fmt, model=spec,
                      strategy=config.get("strategy", "ddp"),
                      precision=config.get("precision", "fp32"), weights=weights, files=[])
    meta = {k: v for k, v in asdict(result).items() if k not in ("files", "run")}
    result.files = _write(module, fmt, dest, meta)
    write_json(os.path.join(dest, PROVENANCE), asdict(result))
    return result
