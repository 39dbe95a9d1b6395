"""``--init-from PATH``: a fresh run that starts from trained weights -- not a resume.

What a fine-tuning user reaches for first (transformers' ``from_pretrained``, Lightning's
``load_from_checkpoint`` for the weights alone). The run is new: step 1, a fresh optimizer
and learning-rate schedule, its own run id; only the model's starting values come from
``PATH``. (To *continue* a run -- optimizer state, schedule, data order -- resume it, or
``--resume-from`` its checkpoint.) What ``PATH`` may be, told apart by what it holds:

* **a gradsync export** (a directory with ``gradsync-export.json``, ``gradsync export``'s):
  its ``model.safetensors`` or ``model.pt``, or for ``--format hf`` the transformers
  directory below;
* **a .safetensors file**: loaded with ``safetensors.torch.load_model`` (tied weights
  stored once come back tied);
* **a transformers directory** (``config.json`` and safetensors weights, what
  ``save_pretrained`` writes) when ``--model`` builds a transformers ``PreTrainedModel``:
  read by that class's ``from_pretrained`` (its key renames, sharded checkpoints, tied
  embeddings) with the factory's own config, safetensors only, and copied into the
  factory's model, so the dtype and settings the factory chose stay;
* **a gradsync run or kept checkpoint** (``RUN``, ``RUN/checkpoints/best``): the trained
  weights ``gradsync export`` would write (fp32 masters of a bf16 run included), after
  the whole unit is verified;
* **a torch state dict** (``.pt``, ``.pth``): read as data only.

Decisions:

* **Data only.** Every file goes through :mod:`gradsync.safeload` (weights only) or
  safetensors; transformers is told ``use_safetensors=True`` and is handed the class, so
  nothing in ``PATH`` can name code to import (no ``trust_remote_code``, no pickle). A
  directory of ``pytorch_model.bin`` only is refused, naming the conversion.
* **Every parameter, exactly.** A name the model has and ``PATH`` lacks, one ``PATH`` has and
  the model lacks, or a shape that differs is one line naming the first, never a warning
  and randomly initialised weights (transformers' default for a missing key).
* **Where**: on every rank, after the model is built and before it is wrapped (the engine
  then checks every rank holds the same and broadcasts rank 0's), on a fresh start only:
  a resumed run's checkpoint holds its weights, and ``PATH`` is not read again (it may be
  gone by then; ``config.json`` records it). ``PATH`` is checked before any worker starts
  (:func:`source_kind`, from ``config/plan.py``).
* Tested: a run started from an export of another run trains bit for bit as a run whose
  model factory returns those weights, and every kind loads an export's logits bitwise
  (``tests/train/test_init_from.py``).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ...errors import UnsafeFileError, UsageError
from ...rundir import CHECKPOINT, read_json
from ...safeload import load as safe_load
from ...safeload import trusting

FLAG = "--init-from"
EXPORT_MARKER = "gradsync-export.json"  # train/checkpoint/export.PROVENANCE
STATE_DICT_SUFFIXES = (".pt", ".pth")
HF_FILES = ("model.safetensors", "model.safetensors.index.json")


def _is_transformers(model: nn.Module) -> bool:
    if not any(c.__module__.split(".")[0] == "transformers" for c in type(model).__mro__):
        return False
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def source_kind(path: str) -> str:
    """What ``path`` is: "export", "safetensors", "hf", "checkpoint" or "state_dict"; one
    line naming ``--init-from`` when it is none of them."""
    if os.path.isdir(path):
        marker = read_json(os.path.join(path, EXPORT_MARKER))
        if isinstance(marker, dict) and marker.get("format") in ("safetensors", "torch", "hf"):
            return "export"
        if os.path.isfile(os.path.join(path, CHECKPOINT)) or os.path.basename(
                os.path.dirname(os.path.normpath(path))) == "checkpoints":
            return "checkpoint"
        if os.path.isfile(os.path.join(path, "config.json")) and any(
                os.path.isfile(os.path.join(path, f)) for f in HF_FILES):
            return "hf"
        if os.path.isfile(os.path.join(path, "pytorch_model.bin")):
            raise UsageError(f"{FLAG} {path} holds only pickle weights (pytorch_model.bin), which "
                             "gradsync does not read (a pickle can run code): save it as "
                             "safetensors (model.save_pretrained(dir, safe_serialization=True))")
        if os.path.isfile(os.path.join(path, "model.safetensors")):
            return "safetensors"
        raise UsageError(f"{FLAG} {path} is a directory of none of the kinds it reads: a gradsync "
                         "export (gradsync-export.json), a transformers directory (config.json "
                         "and model.safetensors), or a run (checkpoint.pt)")
    if os.path.isfile(path):
        if path.endswith(".safetensors"):
            return "safetensors"
        if path.endswith(STATE_DICT_SUFFIXES):
            return "state_dict"
        if os.path.basename(path) == CHECKPOINT:
            return "checkpoint"
        raise UsageError(f"{FLAG} {path}: a file {FLAG} reads ends in .safetensors, or .pt/.pth "
                         "(a state dict, read as data only)")
    if not os.path.lexists(path) and os.path.basename(path) not in ("best", "last"):
        raise UsageError(f"{FLAG} {path}: no such file or directory")
    return "checkpoint"  # RUN/checkpoints/best: resolved (and refused, if need be) there


def _state_dict_problem(model: nn.Module, missing, unexpected) -> str | None:
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        return f"has no value for the model's {sorted(missing)[0]!r}{more}"
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        return f"holds {sorted(unexpected)[0]!r}{more}, which the model does not have"
    return None


def _refuse(path: str, model_name: str, detail: str) -> UsageError:
    return UsageError(f"{FLAG} {path} does not fit --model {model_name}: it {detail}; is it "
                      "this model's?")


def _safetensors(model: nn.Module, path: str, model_name: str) -> None:
    try:
        from safetensors import SafetensorError
        from safetensors.torch import load_model
    except ImportError:
        raise UsageError(f"{FLAG} {path} needs the safetensors package: pip install "
                         "'gradsync[export]' (or pip install safetensors)") from None
    try:
        missing, unexpected = load_model(model, path, strict=False)
    except SafetensorError as e:
        raise UsageError(f"{FLAG} {path} is not a readable safetensors file ({e})") from None
    except RuntimeError as e:  # a shape that differs: torch's load_state_dict
        raise _refuse(path, model_name, _first_line(e)) from None
    problem = _state_dict_problem(model, missing, unexpected)
    if problem:
        raise _refuse(path, model_name, problem)


def _first_line(e: Exception) -> str:
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    return (lines[1] if len(lines) > 1 else lines[0]).rstrip(".") if lines else type(e).__name__


@torch.no_grad()
def _state_dict(model: nn.Module, state, path: str, model_name: str) -> None:
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UsageError(f"{FLAG} {path} is not a state dict (a dict of tensors by parameter name)")
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as e:
        raise _refuse(path, model_name, _first_line(e)) from None
    problem = _state_dict_problem(model, result.missing_keys, result.unexpected_keys)
    if problem:
        raise _refuse(path, model_name, problem)


@torch.no_grad()
def _hf(model: nn.Module, path: str, model_name: str) -> None:
    if not _is_transformers(model):
        raise UsageError(f"{FLAG} {path} is a transformers directory, read by from_pretrained, "
                         f"and --model {model_name} builds a {type(model).__name__}, not a "
                         "transformers PreTrainedModel: give a .safetensors file instead")
    dtype = next((p.dtype for p in model.parameters()), torch.float32)
    try:
        loaded, info = type(model).from_pretrained(
            path, config=model.config, dtype=dtype, use_safetensors=True,
            local_files_only=True, output_loading_info=True)
    except (OSError, ValueError, RuntimeError) as e:
        raise UsageError(f"{FLAG} {path}: from_pretrained could not read it "
                         f"({_first_line(e)})") from None
    mismatched = info.get("mismatched_keys") or []
    if mismatched:
        first = mismatched[0]
        name = first[0] if isinstance(first, (tuple, list)) else first
        raise _refuse(path, model_name, f"holds {name!r} in another shape")
    problem = _state_dict_problem(model, info.get("missing_keys") or [],
                                  info.get("unexpected_keys") or [])
    if problem:
        raise _refuse(path, model_name, problem)
    model.load_state_dict(loaded.state_dict(), strict=True)


def _checkpoint(model: nn.Module, path: str, model_name: str, trust: bool) -> None:
    from ..checkpoint.export_weights import load_trained
    from ..checkpoint.format import load_checkpoint
    from ..checkpoint.kept import resolve_ref
    from ..checkpoint.unit import read_unit

    where = resolve_ref(path, FLAG)
    ckpt = os.path.join(where, CHECKPOINT)
    with trusting(trust):
        read_unit(ckpt)  # every byte of the unit, data only
        state = load_checkpoint(ckpt, verified=False)
        try:
            load_trained(model, state, where, model_name)
        except UsageError as e:
            raise UsageError(f"{FLAG} {path}: {e}") from None


def init_weights(model: nn.Module, path: str, model_name: str, trust: bool = False) -> str:
    """Load ``path``'s weights into ``model`` (see the module docstring); its kind."""
    kind = read = source_kind(path)
    if kind == "export":  # the format it was exported in says which file to read
        fmt = read_json(os.path.join(path, EXPORT_MARKER))["format"]
        read = {"hf": "hf", "safetensors": "safetensors", "torch": "state_dict"}[fmt]
        if fmt == "torch":
            path = os.path.join(path, "model.pt")
    if read == "safetensors":
        _safetensors(model, path if os.path.isfile(path)
                     else os.path.join(path, "model.safetensors"), model_name)
    elif read == "hf":
        _hf(model, path, model_name)
    elif read == "checkpoint":
        _checkpoint(model, path, model_name, trust)
    else:
        try:
            with trusting(trust):  # --trust-checkpoint-code: the user's own pickle, in full
                state = safe_load(path, f"{FLAG} {path}")
        except UnsafeFileError:
            raise
        except Exception as e:  # noqa: BLE001 - not a torch file, truncated: one line
            raise UsageError(f"{FLAG} {path} is not a readable torch file "
                             f"({type(e).__name__}: {e})") from None
        _state_dict(model, state, path, model_name)
    return kind
