"""The ``hybrid-draft`` command: config, doctor, plan, rules, bench, make-checkpoint, smoke,
report.

Bad input to any command is one line on stderr and exit status 2: argument errors say which
argument and what it accepts (without the usage text), each command names the input it
cannot use, and :func:`main` turns anything unforeseen into one line as a last resort
(``HYBRID_DRAFT_TRACEBACK=1`` shows the traceback instead).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from hybrid_draft.core import policy
from hybrid_draft.tools import args as types

#: Set to a non-empty value other than 0 to see the traceback of an unexpected error.
TRACEBACK_ENV = "HYBRID_DRAFT_TRACEBACK"


class Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line: the problem and where help is."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _config(args: argparse.Namespace) -> int:
    from hybrid_draft import settings

    try:
        current = settings.load()
    except settings.ConfigError as exc:
        print(f"hybrid-draft: invalid configuration: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(current.as_dict(), indent=2))
        return 0
    state = "found" if current.config_exists else "absent, defaults apply"
    if current.carried_from is not None:
        state = f"on {current.carried_from}, carried from that Ray driver"
    print(f"config file  {current.config_path} ({state})")
    for name, value in current.as_dict()["settings"].items():
        print(f"{name:<12} {value['value']!s:<24} from {value['source']} ({value['origin']})")
    covered = ", ".join(settings.DECISION_SETTINGS)
    print(f"fingerprint  {current.fingerprint()} (settings_fingerprint, of: {covered})")
    return 0


def _doctor(_args: argparse.Namespace) -> int:
    from hybrid_draft.tools import doctor

    return doctor.run()


def _plan(args: argparse.Namespace) -> int:
    from hybrid_draft.tools import plan

    return plan.run(args)


def _rules(args: argparse.Namespace) -> int:
    from hybrid_draft.adapter import internals
    from hybrid_draft.tools import draftinfo

    classes = draftinfo.draft_classes()
    if args.json:
        print(json.dumps({"vllm_version": internals.vllm_version(), "classes": classes}, indent=2))
        return 0
    from hybrid_draft.tools import tables

    columns = [(h, "left") for h in ("architecture", "class", "kind", "rule", "detail")]
    rows = [[c["architecture"], c["class"], c["kind"], c["rule"], c["detail"]] for c in classes]
    print(tables.render(columns, rows))
    print(draftinfo.rules_summary(classes))
    return 0


def _make_checkpoint(args: argparse.Namespace) -> int:
    from pathlib import Path

    from hybrid_draft.tools import agree, synth

    out = Path(args.out_dir)
    prog = "hybrid-draft make-checkpoint"
    presets = synth.PRESETS[args.arch]
    preset = args.preset or ("default" if "default" in presets else "tiny")
    if preset not in presets:
        print(
            f"{prog}: --preset {preset!r} is not one of --arch "
            f"{args.arch}'s presets: {', '.join(presets)}",
            file=sys.stderr,
        )
        return 2
    try:
        state = synth.target_state(out)
        if args.if_missing and state == "complete":
            print(f"{out}: a checkpoint is already there; leaving it")
            return 0
        if state in ("occupied", "complete") and not args.force:
            print(
                f"{prog}: {out} is not empty; pass --force to write the checkpoint into it "
                "(replacing only the files make-checkpoint writes), or name a new or empty "
                "directory",
                file=sys.stderr,
            )
            return 2
        kwargs = {"moe": args.moe} if args.arch not in ("qwen3_5", "qwen3") else {}
        layout = synth.ARCHITECTURES[args.arch](preset, **kwargs)
        # Only seeded values can agree: noise and sparse fills make no claim.
        draft = None
        if args.fill == "normal":
            draft = agree.RANDOM if args.random_draft else agree.AGREES
        claim = draft if draft is None or layout.is_mtp else agree.NONE
        shards = synth.shard(layout, num_shards=args.shards, mtp_own_shard=args.mtp_own_shard)
        with synth.marked(out):
            if args.tokenizer:
                synth.write_tokenizer(out, layout.config["vocab_size"])
            synth.write_checkpoint(out, layout, shards, fill=args.fill, seed=args.seed, draft=draft)
    except (OSError, synth.TargetError) as exc:
        print(f"{prog}: {_os_error(exc)}", file=sys.stderr)
        return 2
    said = {
        agree.AGREES: "its MTP draft agrees with its target",
        agree.RANDOM: "a random MTP draft",
        agree.NONE: "no MTP layer",
        None: f"no claim about its draft (--fill {args.fill})",
    }[claim]
    print(
        f"{out}: {args.arch}/{preset}, {len(shards)} shards, "
        f"{len(layout.tensors)} tensors, {layout.nbytes / 1e6:.1f} MB, {said}"
    )
    return 0


def _os_error(exc: BaseException) -> str:
    """One line for an OSError (the path and the reason) or any other error."""
    from hybrid_draft import files

    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{files.show_path(exc.filename)}: {exc.strerror or exc}"
    return files.one_line(str(exc))


def _smoke(args: argparse.Namespace) -> int:
    from hybrid_draft.tools import smoke

    return smoke.main(args)


def _report(args: argparse.Namespace) -> int:
    from hybrid_draft import files
    from hybrid_draft.tools import report

    try:
        summary = report.summarize(report.read_file(args.events_file))
    except FileNotFoundError:
        detail = "No such file or directory"
    except files.FileProblem as exc:
        detail = exc.detail
    else:
        print(json.dumps(summary, indent=2) if args.json else report.render(summary))
        return 0
    print(
        f"hybrid-draft report: cannot read {files.show_path(args.events_file)}: {detail}",
        file=sys.stderr,
    )
    return 2


def _bench(args: argparse.Namespace) -> int:
    from hybrid_draft.tools.bench import run

    return run.main(args)


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="hybrid-draft", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("config", help="the effective settings and where each came from")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=_config)

    d = sub.add_parser("doctor", help="check that the layer is installed, active and usable")
    d.set_defaults(func=_doctor)

    pl = sub.add_parser("plan", help="what a same-checkpoint MTP draft reads under each mode")
    pl.add_argument("model_dir", help="a checkpoint directory, or an s3://, gs:// or az:// address")
    pl.add_argument("--json", action="store_true")
    pl.add_argument(
        "--load-format",
        choices=policy.TARGET_FORMATS,
        default=None,
        help="the target's load format (default: instanttensor; runai_streamer for an "
        "object-storage address)",
    )
    pl.add_argument(
        "--timeout",
        type=types.at_most(types.positive, 3600.0),
        default=120.0,
        help="seconds to wait for object storage (default 120)",
    )
    pl.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let transformers run configuration code shipped with the checkpoint "
        "(never run otherwise)",
    )
    pl.set_defaults(func=_plan)

    r = sub.add_parser(
        "rules",
        help="every speculative draft class vLLM registers and "
        "whose checkpoint-weight rule prunes it",
    )
    r.add_argument("--json", action="store_true")
    r.set_defaults(func=_rules)

    from hybrid_draft.tools import synth  # stdlib only: cheap enough for every command

    m = sub.add_parser(
        "make-checkpoint",
        help="write a checkpoint with an MTP layer whose draft agrees with its target",
    )
    m.add_argument("out_dir")
    m.add_argument("--arch", choices=sorted(synth.ARCHITECTURES), default="qwen3_5")
    listed = "; ".join(f"{a}: {', '.join(p)}" for a, p in synth.PRESETS.items())
    m.add_argument(
        "--preset",
        default=None,
        help=f"the shapes ({listed}); default: `default` where the architecture "
        f"has one, else `tiny`. `cpu` ({', '.join(synth.CPU_SERVABLE)}): "
        "shapes vLLM's CPU build serves",
    )
    m.add_argument("--shards", type=types.integer(1, 100_000), default=2)
    m.add_argument("--mtp-own-shard", action=argparse.BooleanOptionalAction, default=True)
    m.add_argument("--moe", action=argparse.BooleanOptionalAction, default=True)
    m.add_argument("--fill", choices=["normal", "noise", "sparse"], default="normal")
    m.add_argument("--seed", type=types.integer(0, (1 << 63) - 1), default=0)
    m.add_argument("--tokenizer", action=argparse.BooleanOptionalAction, default=True)
    m.add_argument(
        "--random-draft",
        action="store_true",
        help="random weights everywhere, the MTP layer's included (its proposals are "
        "rejected); default: blocks that pass their input through, a structured embedding "
        "and head, and a draft that agrees with its target by construction (with --fill "
        "normal; the index's metadata says which)",
    )
    m.add_argument(
        "--if-missing",
        action="store_true",
        help="do nothing when OUT_DIR already holds a complete checkpoint",
    )
    m.add_argument(
        "--force",
        action="store_true",
        help="write into a non-empty OUT_DIR, replacing the files make-checkpoint writes "
        "(never through a symbolic link; other files are left)",
    )
    m.set_defaults(func=_make_checkpoint)

    s = sub.add_parser(
        "smoke",
        help="check a running server: models, completions, "
        "speculative metrics and the layer's events",
    )
    from hybrid_draft.tools import smoke

    smoke.add_arguments(s)
    s.set_defaults(func=_smoke)

    r = sub.add_parser(
        "report",
        help="what each model load in an events file cost, and "
        "what the draft saved against a second full pass",
    )
    r.add_argument("events_file", help="the layer's JSONL events file (HYBRID_DRAFT_EVENTS_FILE)")
    r.add_argument("--json", action="store_true")
    r.set_defaults(func=_report)

    b = sub.add_parser("bench", help="the draft-load benchmark (CPU; GPU strategies with CUDA)")
    from hybrid_draft.tools.bench import run

    run.add_arguments(b)
    b.set_defaults(func=_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parser().parse_args(argv)
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("hybrid-draft: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): nothing more to say
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 1
    except Exception as exc:  # the last line of defence: one line, never a traceback
        if os.environ.get(TRACEBACK_ENV, "").strip() not in ("", "0"):
            raise
        from hybrid_draft import files

        command = next(
            (a for a in (argv if argv is not None else sys.argv[1:]) if a[:1] != "-"), ""
        )
        print(
            f"hybrid-draft{' ' + command if command else ''}: unexpected error: "
            f"{type(exc).__name__}: {files.one_line(str(exc))} ({TRACEBACK_ENV}=1 shows where)",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
