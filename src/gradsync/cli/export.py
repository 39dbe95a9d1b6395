"""`gradsync export RUN --format safetensors|torch|hf DIR`: the trained model, out of a run."""

from __future__ import annotations

import argparse


def register(sub, help_line: str) -> argparse.ArgumentParser:
    from ..train.checkpoint.export import FORMATS

    p = sub.add_parser(
        "export", help=help_line,
        description=help_line[0].upper() + help_line[1:] + ". The run's checkpoint is "
        "verified first and read as data only (a damaged or crafted one is refused); ZeRO "
        "and stage-3 shards are joined into one model (fp32 master weights of a bf16 run). "
        "The model is rebuilt (from --model, or the run's built-in model) and loaded before "
        "it is written, so the export is known to fit it. "
        "See docs/logging-and-export.md.",
    )
    p.add_argument("run_dir", metavar="RUN", help="a run directory (gradsync train --out), a "
                   "kept checkpoint (RUN/checkpoints/step-N) or RUN/checkpoints/best / last")
    p.add_argument("dest", metavar="DIR", help="where to write the model (created if needed)")
    p.add_argument("--format", required=True, choices=FORMATS,
                   help="safetensors: DIR/model.safetensors (tied weights stored once); "
                        "torch: DIR/model.pt, the state dict; hf: save_pretrained(DIR), for a "
                        "transformers model")
    p.add_argument("--model", default=None, metavar="SPEC",
                   help="rebuild the model from this pkg.module:factory, path/to/file.py:factory "
                        "or built-in name. Needed when the run was trained with a factory: "
                        "export imports only the code the command line names, never a factory "
                        "a run directory records (it may come from someone else)")
    p.add_argument("--data", default=None, metavar="SPEC",
                   help="with --format hf: the data factory (pkg.module:factory) whose "
                        "TrainData.tokenizer is saved beside the model (save_pretrained), so "
                        "AutoTokenizer.from_pretrained(DIR) loads it; imported only because the "
                        "command line names it")
    p.add_argument("--overwrite", action="store_true",
                   help="write into DIR although it holds files gradsync did not export "
                        "(files of the same names are replaced, the others left alone); "
                        "without it only a new or empty DIR, or one holding a gradsync export, "
                        "is written")
    p.add_argument("--trust-checkpoint-code", action="store_true",
                   help="load the run's checkpoint with full pickle, which can run code the "
                        "file names: only for a checkpoint you wrote yourself holding your own "
                        "types. Without it the checkpoint is read as data only, as every "
                        "checkpoint gradsync writes is")
    p.set_defaults(run=run)
    return p


def run(args) -> int:
    from ..train.checkpoint.export import export_run

    r = export_run(args.run_dir, args.format, args.dest, model=args.model,
                   overwrite=args.overwrite, trust_code=args.trust_checkpoint_code,
                   data=args.data)
    print(f"gradsync export: step {r.step} of {r.run} ({r.strategy}, {r.precision}; "
          f"{r.weights}) -> {args.dest}: {', '.join(r.files)}")
    if args.format == "hf" and r.tokenizer is None:
        why = ("its --data gives none" if args.data else "give --data pkg.module:factory "
               "to save your TrainData.tokenizer beside the model")
        print(f"gradsync export: no tokenizer exported ({why})")
    return 0
