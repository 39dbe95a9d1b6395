"""``gradsync export RUN --format safetensors|torch|hf DIR``: the trained model, out of a run.

The checkpoint is verified as a resume verifies it (``unit.read_unit``: every byte
of ``checkpoint.pt`` and of its shard directory, and every file read as data only,
:mod:`gradsync.safeload`) before anything is read; a damaged or crafted one is
refused in one line. The model is rebuilt from the export's ``--model``, or from the
run's ``config.json`` spec when that is a built-in name: a ``pkg.module:factory`` the
run recorded is imported only when the command line names it (a run directory may
come from someone else, and importing its factory runs its code); otherwise one line
says which factory the run used and how to pass it. The trained weights are loaded
into it (``export_weights``: fp32 masters where the run kept them, consolidated
from ZeRO shards), and written:

* ``safetensors``: ``DIR/model.safetensors`` by ``safetensors.torch.save_model``,
  which stores a tied weight once (a plain ``save_file`` refuses shared tensors);
  load with ``safetensors.torch.load_model(model, path)``;
* ``torch``: ``DIR/model.pt``, the state dict (``model.load_state_dict(torch.load(path))``);
* ``hf``: ``model.save_pretrained`` (config.json + model.safetensors), for a
  transformers ``PreTrainedModel``; ``AutoModel*.from_pretrained(DIR)`` loads it.
  Any other model is refused, suggesting ``--format safetensors``. With ``--data``, the
  data factory's tokenizer (``TrainData.tokenizer``) is saved beside it
  (``tokenizer.save_pretrained``), so ``AutoTokenizer.from_pretrained(DIR)`` loads the
  tokenizer the model was trained with: the factory is run only because the command line
  names it, as ``--model``'s is.

``DIR/gradsync-export.json`` says where the weights came from (run, run id, step,
strategy, precision, which weights). ``DIR`` is gradsync's to write into when it is
new, empty or holds a gradsync export (its ``gradsync-export.json``); anything else is
refused before anything is read, with ``--overwrite`` to go on (:mod:`gradsync.ownership`).
Every file goes through gradsync's atomic writer (:mod:`gradsync.atomic`): whole or
not at all, never through a symbolic link, with the permissions the umask gives the
user's other files; a full or read-only disk is one line naming the file.
"""

from __future__ import annotations

import errno
import functools
import io
import os
import re
import shlex
import shutil
import tempfile
from dataclasses import asdict, dataclass

import torch
from torch import nn

from ...atomic import TMP_PREFIX, cause, storage_error, write_by_name, write_bytes
from ...errors import StorageError, UsageError
from ...factory import is_factory_spec, load_factory
from ...models import MODELS, build_model
from ...ownership import entries, refusal
from ...rundir import CHECKPOINT, read_json, write_json
from ...safeload import trusting
from .export_weights import load_trained
from .format import load_checkpoint
from .kept import NAMES, resolve_ref
from .unit import read_unit

FORMATS = ("safetensors", "torch", "hf")
FILES = {"safetensors": "model.safetensors", "torch": "model.pt"}
PROVENANCE = "gradsync-export.json"
SAFETENSORS_PIP = "pip install 'gradsync[export]' (or pip install safetensors)"
WHAT = "the exported model"


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
    tokenizer: str | None = None  # hf: the --data factory's tokenizer class, saved beside


def _shown(spec: str) -> str:
    """``spec`` as a shell word a user can paste (a recorded one may hold anything)."""
    return shlex.quote(spec) if spec.isprintable() else repr(spec)


def model_spec(named: str | None, config: dict, run_dir: str, command: str = "gradsync export",
               flag: str = "model", builtins=MODELS) -> str:
    """The model (``flag``: or the data) to rebuild: the command line's, or the run's own
    when that is a built-in name. A factory the run recorded is never imported on its word."""
    if named:
        return named
    recorded = config.get(flag)
    if isinstance(recorded, str) and recorded in builtins:
        return recorded
    if isinstance(recorded, str) and is_factory_spec(recorded):
        raise UsageError(f"{run_dir} was trained with --{flag} {_shown(recorded)}, which "
                         f"{command} imports only when the command line names it (a run "
                         "directory may come from someone else, and importing a factory runs "
                         f"its code): if you trust that code, pass --{flag} {_shown(recorded)}")
    raise UsageError(f"the run's {flag} {recorded!r} cannot be rebuilt: pass --{flag} "
                     f"pkg.module:factory (or one of {', '.join(builtins)})")


def _whole(value, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def build_model_of(spec: str, config: dict) -> nn.Module:
    """The model ``spec`` names (the command line's, or a built-in), freshly built and
    seeded as the run was, to load the weights into."""
    torch.manual_seed(_whole(config.get("seed"), 0))
    if is_factory_spec(spec):
        model = load_factory(spec)()
        if not isinstance(model, nn.Module):
            raise UsageError(f"model factory {spec} returned {type(model).__name__}, not a "
                             "torch.nn.Module")
        return model
    if spec not in MODELS:
        raise UsageError(f"the run's model {spec!r} cannot be rebuilt: pass --model "
                         f"pkg.module:factory (or one of {', '.join(MODELS)})")
    return build_model("gpt", seq_len=_whole(config.get("seq_len"), 128)) if spec == "gpt" \
        else build_model(spec)


def is_transformers_model(model: nn.Module) -> bool:
    """A transformers ``PreTrainedModel`` (transformers is imported only if the model's
    class comes from it, or from a subclass of one of its classes)."""
    names = {c.__module__.split(".")[0] for c in type(model).__mro__}
    if "transformers" not in names:
        return False
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def is_export(dest: str) -> bool:
    """Whether ``dest`` holds a gradsync export (its provenance file, as written here)."""
    value = read_json(os.path.join(dest, PROVENANCE))
    return isinstance(value, dict) and value.get("format") in FORMATS and "run" in value


def check_dest(dest: str, fmt: str, overwrite: bool) -> None:
    """``dest`` is a directory gradsync may write into (see the module docstring)."""
    if os.path.lexists(dest) and not os.path.isdir(dest):
        raise UsageError(f"{dest} exists and is not a directory")
    found = entries(dest)
    if found and not overwrite and not is_export(dest):
        writes = FILES.get(fmt, "the model's files (config.json, model.safetensors, ...)")
        raise refusal(dest, found, "export into a new or empty directory, or one that holds "
                      "an earlier gradsync export", f"{writes} and {PROVENANCE}")


def _need_safetensors() -> None:
    try:
        import safetensors.torch  # noqa: F401
    except ImportError:
        raise UsageError(f"--format safetensors needs the safetensors package: "
                         f"{SAFETENSORS_PIP}") from None


def _os_error(e: Exception) -> OSError:
    """A library's failed write as the OSError it was ("... (os error 28)": no space)."""
    m = re.search(r"os error (\d+)", str(e))
    code = int(m.group(1)) if m else errno.EIO
    return OSError(code, os.strerror(code))


def _save_safetensors(model: nn.Module, path: str, metadata: dict) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import save_model

    def write(tmp: str) -> None:
        try:
            save_model(model, tmp, metadata={k: str(v) for k, v in metadata.items()})
        except SafetensorError as e:
            raise _os_error(e) from None

    write_by_name(path, WHAT, write)


def _save_hf(model: nn.Module, dest: str, tokenizer=None) -> list[str]:
    """``save_pretrained`` (the model's, and the tokenizer's when there is one) into a
    private staging directory inside ``dest``, then each file moved into place through the
    atomic writer; returns the files' names."""
    try:
        staging = tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-hf-", dir=dest)
    except OSError as e:
        raise storage_error(e, WHAT, dest) from None
    try:
        try:
            model.save_pretrained(staging)
            if tokenizer is not None:
                tokenizer.save_pretrained(staging)
        except OSError as e:
            raise storage_error(e, WHAT, dest) from None
        except Exception as e:
            if type(e).__name__ != "SafetensorError":
                raise
            raise storage_error(_os_error(e), WHAT, dest) from None
        names = sorted(os.path.relpath(os.path.join(root, n), staging)
                       for root, _dirs, files in os.walk(staging) for n in files)
        for name in names:
            target = os.path.join(dest, name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            write_by_name(target, WHAT, functools.partial(os.replace, os.path.join(staging, name)))
        return names
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _write(model: nn.Module, fmt: str, dest: str, meta: dict, tokenizer=None) -> list[str]:
    if fmt == "hf":
        return _save_hf(model, dest, tokenizer)
    path = os.path.join(dest, FILES[fmt])
    if fmt == "safetensors":
        _save_safetensors(model, path, meta)
    else:
        buf = io.BytesIO()
        torch.save(model.state_dict(), buf)
        write_bytes(path, buf.getvalue(), WHAT)
    return [FILES[fmt]]


def tokenizer_of(data: str, fmt: str):
    """The tokenizer the command line's ``--data`` factory provides (``TrainData.tokenizer``),
    for an hf export; None when it has none. The factory runs: it is the command line's."""
    if fmt != "hf":
        raise UsageError(f"--data exports the data's tokenizer with --format hf (its "
                         f"save_pretrained beside the model's); --format {fmt} writes the "
                         "weights only: leave out --data")
    if not is_factory_spec(data):
        return None  # a built-in dataset: bytes or characters, no tokenizer to save
    got = load_factory(data, "--data")()
    tokenizer = getattr(got, "tokenizer", None)
    if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
        raise UsageError(f"--data {data}: its TrainData.tokenizer is a "
                         f"{type(tokenizer).__name__}, which has no save_pretrained (give a "
                         "transformers tokenizer, or none)")
    return tokenizer


def export_run(run_dir: str, fmt: str, dest: str, model: str | None = None,
               overwrite: bool = False, trust_code: bool = False,
               data: str | None = None) -> Exported:
    """Write the trained model of ``run_dir``'s checkpoint to ``dest`` in format ``fmt``.

    ``model``: the command line's ``--model`` (the run's own is used only when it is a
    built-in); ``overwrite``: ``--overwrite``; ``trust_code``: ``--trust-checkpoint-code``;
    ``data``: the command line's ``--data``, whose ``TrainData.tokenizer`` an hf export
    carries (``save_pretrained`` beside the model's files).
    """
    if fmt not in FORMATS:
        raise UsageError(f"unknown --format {fmt!r}; choose from {', '.join(FORMATS)}")
    if os.path.basename(os.path.normpath(run_dir)) in NAMES:  # RUN/checkpoints/best (kept.py)
        run_dir = resolve_ref(run_dir, "gradsync export")
    path = os.path.join(run_dir, CHECKPOINT)
    if not os.path.isdir(run_dir):
        raise UsageError(f"{run_dir} is not a run directory")
    check_dest(dest, fmt, overwrite)  # before anything is read
    if fmt == "safetensors":
        _need_safetensors()
    with trusting(trust_code):  # data only, unless the user opted in
        header = read_unit(path)  # every byte of the unit verified, or one line saying why not
        if header is None:
            raise UsageError(f"{run_dir} holds no checkpoint ({CHECKPOINT}): nothing to export")
        state = load_checkpoint(path, verified=False)
    config = state.get("config") or {}
    spec = model_spec(model, config, run_dir)
    module = build_model_of(spec, config)
    if fmt == "hf" and not is_transformers_model(module):  # before anything is written
        raise UsageError(f"--format hf needs a transformers PreTrainedModel; the run's model "
                         f"is a {type(module).__name__}: use --format safetensors")
    with trusting(trust_code):
        weights = load_trained(module, state, run_dir, spec)
    module.eval()
    tokenizer = tokenizer_of(data, fmt) if data else None  # before anything is written
    try:
        os.makedirs(dest, exist_ok=True)
    except OSError as e:
        raise StorageError(f"{cause(e)} while creating {dest}", e.errno or 0) from None
    result = Exported(run=os.path.abspath(run_dir), run_id=header.get("run_id"),
                      step=int(header["step"]), format=fmt, model=spec,
                      strategy=config.get("strategy", "ddp"),
                      precision=config.get("precision", "fp32"), weights=weights, files=[],
                      tokenizer=type(tokenizer).__name__ if tokenizer is not None else None)
    meta = {k: v for k, v in asdict(result).items()
            if k not in ("files", "run", "tokenizer")}
    result.files = _write(module, fmt, dest, meta, tokenizer)
    write_json(os.path.join(dest, PROVENANCE), asdict(result), what="the export's provenance")
    return result
