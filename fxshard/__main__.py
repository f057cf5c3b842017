"""python -m fxshard demo | explain | generate: a tiny bundled Llama on a simulated (or real) mesh.

  python -m fxshard demo                        dp=2, tp=2 on a simulated mesh
  python -m fxshard demo --mesh tp=4 --sp       tensor + sequence parallel
  python -m fxshard explain --mesh dp=2,tp=2,pp=2 --microbatches 2 --svg /tmp/plan.svg
  python -m fxshard generate --mesh tp=2 --prompt-len 8 --new-tokens 16
  torchrun --nproc_per_node=4 -m fxshard demo --mesh dp=2,tp=2    real ranks (gloo)

demo prints its verdict first (the largest difference from the single-device model, PASS or
FAIL), then the plan (collectives and parameter bytes per rank) and one layer of rank 0's
program; explain prints the plan only; "COMMAND --help" lists a command's options;
generate prints greedy tokens from pm.generate, whether they equal the single-device model's
(a plain loop without a cache) and the prefill time and decode tokens per second.
The long steps (tracing, building the rank programs, the single-device reference) say what
they are doing on stderr (--quiet: not), and fxshard's warnings come as one-line notes there
with the CLI's options (--plan, --strict) as the fix.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import os
import re
import sys
import time
import warnings

import torch
from .mesh import DP, FSDP, RING, TP, ULYSSES


TOLERANCE = 1e-4  # the demo's pass mark: largest |parallel - single device|, fp32


def _parse_mesh(text: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``"dp=2,tp=2"`` -> ``((2, 2), ("dp", "tp"))``; an argparse error (usage, no traceback)
    for anything else."""
    from fxshard.mesh import AXIS_NAMES, canonical_axis
    names, shape = [], []
    for part in text.split(","):
        name, eq, size = part.partition("=")
        if not eq or not size.strip().isdigit() or int(size) < 1:
            raise argparse.ArgumentTypeError(
                f"expected NAME=SIZE pairs with sizes >= 1, like dp=2,tp=2; got {part!r} in "
                f"{text!r}")
        try:
            names.append(canonical_axis(name.strip(), where="--mesh"))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"unknown axis {name.strip()!r}; use {', '.join(AXIS_NAMES)}") from None
        shape.append(int(size))
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r} names an axis twice")
    return tuple(shape), tuple(names)


def _positive(text: str) -> int:
    """An int >= 1; an argparse error (usage, no traceback) otherwise."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


_PLAN_STYLES = ("colwise", "rowwise", "vocab", "embed_dim", "replicate")


def _parse_plan(text: str) -> dict[str, str]:
    """``"model.layers.*.mlp.*=replicate,lm_head=embed_dim"`` -> the ``plan=`` dict of
    fxshard.parallelize; an argparse error (usage, no traceback) for anything else."""
    plan = {}
    for part in text.split(","):
        glob, eq, style = (p.strip() for p in part.partition("="))
        if not eq or not glob or style not in _PLAN_STYLES:
            raise argparse.ArgumentTypeError(
                f"expected MODULE_GLOB=STYLE pairs with a style of {', '.join(_PLAN_STYLES)}, "
                f"like model.layers.*.self_attn.k_proj=replicate; got {part!r}")
        plan[glob] = style
    return plan


def _writable(path: str) -> str:
    """A file path whose folder exists and can be written (checked before the run, so the
    picture does not fail after it)."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path!r} is a directory; give a file name such as "
                                         f"plan.svg")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"the folder {folder!r} of {path!r} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{path!r} cannot be written (permission denied)")
    return path


def layer_excerpt(code: str) -> list[str]:
    """One decoder layer of a rank program's code: from the end of the previous layer (its
    residual add) to this layer's own residual add, so its collectives show; the whole code
    when no layer is recognised. Weight fetches (``x = self.model...``) are left out."""
    lines = [ln for ln in code.strip().splitlines()[1:]
             if not re.match(r"\s+\w+ = (self\.|getattr\(self)", ln)]
    layers = sorted({int(m) for ln in lines for m in re.findall(r"model_layers_(\d+)_", ln)})
    if not layers:
        return lines

    def end(layer: int) -> int:
        last = max(i for i, ln in enumerate(lines) if f"model_layers_{layer}_" in ln)
        for i in range(last + 1, min(last + 6, len(lines))):
            if re.match(r"\s+add\w* = torch\.ops\.aten\.add\.Tensor", lines[i]):
                return i
        return last

    layer = layers[1] if len(layers) > 1 else layers[0]
    start = end(layer - 1) + 1 if layer - 1 in layers else 0
    return lines[start:end(layer) + 1]


def _ran_on(pm) -> str:
    import torch.distributed as dist
    if dist.is_initialized():
        return (f"ran on: torch.distributed ({dist.get_backend()}), {dist.get_world_size()} "
                f"processes, mesh {pm.spec.describe()}")
    return (f"ran on: simulated mesh {pm.spec.describe()}, {pm.spec.world_size} ranks as "
            f"threads of this process ({pm.spec.device_type})")


_COMMANDS = {
    "demo": "run on the mesh and compare with one device: the verdict, the plan, one layer",
    "explain": "the plan only: placements, collectives, bytes per rank (and a picture)",
    "generate": "greedy text generation with pm.generate, compared with one device",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fxshard", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--mesh", default=((2, 2), (DP, TP)), type=_parse_mesh,
                        help="axis sizes, e.g. dp=2,tp=2 (axes: dp, fsdp, tp, pp, "
                             "ulysses_cp, ring_cp; default dp=2,tp=2)")
    common.add_argument("--sp", action="store_true",
                        help="sequence parallelism on tp (generate: the prefill; a decode step "
                             "has one token)")
    common.add_argument("--layers", type=_positive, default=4, help="decoder layers (default 4)")
    common.add_argument("--microbatches", type=_positive, default=1,
                        help="pipeline microbatches (GPipe; needs pp; default 1)")
    common.add_argument("--batch", type=_positive, default=None,
                        help="batch size (default: the smallest multiple of dp x microbatches "
                             "that is >= 4)")
    common.add_argument("--plan", type=_parse_plan, default=None, metavar="GLOB=STYLE,...",
                        help="tensor-parallel overrides by module-name glob, e.g. "
                             "model.layers.*.self_attn.k_proj=replicate (styles: "
                             f"{', '.join(_PLAN_STYLES)}); parallelize's plan=")
    common.add_argument("--strict", action="store_true",
                        help="an op without a sharding rule, or a weight kept whole, is an "
                             "error instead of a note")
    common.add_argument("--quiet", action="store_true",
                        help="no progress lines on stderr (the tracing and building steps)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="; ".join(f"{k}: {v}" for k, v in _COMMANDS.items())
                                + "; plan: rank meshes for a config.json (fxshard.plan)")
    from fxshard.plan.cli import add_parser
    add_parser(sub)
    for name, text in _COMMANDS.items():
        p = sub.add_parser(name, parents=[common], help=text, description=text)
        if name == "generate":
            p.add_argument("--prompt-len", type=_positive, default=None,
                           help="prompt tokens per sequence (default 8, or the smallest "
                                "multiple of 2 x ring_cp x ulysses_cp above it)")
            p.add_argument("--new-tokens", type=_positive, default=16,
                           help="new tokens per sequence (default 16)")
            p.add_argument("--seed", type=_integer, default=1,
                           help="seed of the random prompt (default 1)")
            continue
        p.add_argument("--seq", type=_positive, default=None,
                       help="sequence length (default 16, or the smallest multiple of "
                            "2 x ring_cp x ulysses_cp above it)")
        if name == "demo":
            p.add_argument("--lines", type=_positive, default=60,
                           help="at most this many lines of rank 0's layer excerpt "
                                "(default 60)")
        p.add_argument("--svg", metavar="FILE", type=_writable,
                       help="also draw the plan to FILE (.svg/.png; needs matplotlib: "
                            "pip install 'fxshard[plot]')")
    return parser


class _Progress:
    """What the long steps are doing, one line each on stderr, on rank 0 only (torchrun's
    ``RANK``); nothing with ``--quiet``. fxshard's library calls print nothing themselves."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and os.environ.get("RANK", "0") == "0"

    @contextlib.contextmanager
    def step(self, doing: str, done: str = "done"):
        """``doing ...`` before the step, ``done in N s`` after it."""
        self.say(f"{doing} ...")
        start = time.perf_counter()
        yield
        self.say(f"{done} in {time.perf_counter() - start:.1f} s")

    def say(self, line: str) -> None:
        if self.enabled:
            print(line, file=sys.stderr, flush=True)


@contextlib.contextmanager
def _notes(where: str):
    """fxshard's warnings as one-line notes on stderr (rank 0 only), with the CLI's options as
    the fix and without a source location (which would be runpy's); other warnings as usual."""
    shown: set[str] = set()
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        default_show = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if not category.__module__.startswith("fxshard"):
                return default_show(message, category, filename, lineno, file, line)
            note = f"{where}: note: {_cli_note(str(message))}"
            if note not in shown and os.environ.get("RANK", "0") == "0":
                shown.add(note)
                print(note, file=sys.stderr, flush=True)
        warnings.showwarning = show
        yield


def _cli_note(message: str) -> str:
    """An fxshard warning on one line, its ``plan=`` / ``strict=True`` advice in the CLI's
    options: ``--plan GLOB=STYLE,...``, ``--strict``."""
    lines = message.removeprefix("fxshard: ").splitlines()
    head, details = lines[0], [ln.strip() for ln in lines[1:] if ln.startswith(" ")]
    advice = " ".join(ln for ln in lines[1:] if not ln.startswith(" "))
    text = head.rstrip(".") + (f" ({'; '.join(details)})" if details else "") + "."
    plans = re.findall(r"plan=(\{[^{}]*\})", advice)
    fix = _plan_option(plans[-1]) if plans else None
    if fix:
        return (f"{text} Accept them with --plan '{fix}' (silences this note); --strict makes "
                f"it an error.")
    return f"{_for_the_cli(' '.join((text, advice)).strip())}"


def _plan_option(literal: str) -> str | None:
    """``"{'a.*': 'replicate'}"`` -> ``"a.*=replicate"`` (``--plan``'s form); None when it
    names no real module (a placeholder such as ``'<attention projections>'``)."""
    try:
        plan = ast.literal_eval(literal)
    except (ValueError, SyntaxError):
        return None
    if not isinstance(plan, dict) or any("<" in str(k) for k in plan):
        return None
    return ",".join(f"{k}={v}" for k, v in plan.items())


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "plan":
        from fxshard.plan.cli import run
        try:
            return run(args)
        except (ValueError, NotImplementedError, OSError) as e:
            parser.exit(2, f"{parser.prog} plan: error: {e}\n")
    sizes = dict(zip(args.mesh[1], args.mesh[0]))
    if args.batch is None:  # fit the mesh: every dp rank and microbatch gets a sequence
        unit = sizes.get(DP, 1) * sizes.get(FSDP, 1) * args.microbatches
        args.batch = unit * -(-4 // unit)
    unit = 2 * sizes.get(RING, 1) * sizes.get(ULYSSES, 1)  # zigzag: 2 chunks a rank
    for name, default in (("seq", 16), ("prompt_len", 8)):
        if getattr(args, name, 0) is None:
            setattr(args, name, unit * -(-default // unit))
    where = f"{parser.prog} {args.command}: error"
    try:
        with _notes(f"{parser.prog} {args.command}"):
            return _run(args)
    except (ValueError, TypeError, NotImplementedError) as e:  # fxshard's errors say the fix
        parser.exit(2, f"{where}: {_for_the_cli(str(e))}\n")
    except MemoryError as e:
        parser.exit(1, f"{where}: out of memory ({str(e) or 'MemoryError'}); use a smaller "
                       f"--batch, --seq, --layers or mesh\n")
    except OSError as e:
        parser.exit(1, f"{where}: {e}\n")


def _for_the_cli(message: str) -> str:
    """fxshard's messages suggest API fixes: ``plan={...}`` naming modules becomes ``--plan``,
    ``strict=True`` ``--strict``; advice with a placeholder module (no ``--plan`` to give) is
    dropped for what the CLI can change instead."""
    message = message.replace("fxshard.parallelize(strict=True): ", "--strict: ")
    message = message.replace("strict=True", "--strict")

    def option(match: re.Match) -> str:
        fix = _plan_option(match.group(1))
        return f"--plan '{fix}'" if fix else match.group(0)
    message = re.sub(r"plan=(\{[^{}]*\})", option, message)
    if "plan=" not in message:
        return message
    message = re.sub(r",? or [^.]*?plan=\{.*?\}\}?[^.]*", "", message)
    message = re.sub(r"(^|(?<=\. ))[^.]*plan=\{.*?\}\}?[^.]*\.?", "", message).rstrip()
    return (f"{message} From the CLI: change --mesh (sizes that divide the tiny Llama's 4 "
            f"query heads, 2 KV heads and hidden size 64, e.g. --mesh tp=2)")


def _run(args) -> int:
    import torch.distributed as dist

    import fxshard
    from fxshard.models.llama import LlamaConfig, LlamaForCausalLM

    shape, names = args.mesh
    # under torchrun this starts the default (gloo) process group
    mesh = fxshard.init_device_mesh("cpu", shape, mesh_dim_names=names)
    rank = dist.get_rank() if dist.is_initialized() else 0
    progress = _Progress(not args.quiet)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig.tiny(num_hidden_layers=args.layers)).eval()
    options = dict(sequence_parallel=args.sp, microbatches=args.microbatches, plan=args.plan,
                   strict=args.strict)
    where = (f"{type(model).__name__} ({args.layers} layer{'s' * (args.layers > 1)}) on mesh "
             f"{_mesh_text(args.mesh)}")
    if args.command == "generate":
        ids = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt_len),
                            device="cpu", generator=torch.Generator().manual_seed(args.seed))
        pm = fxshard.parallelize(model, mesh, **options)   # traced at the first generate
    else:
        ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device="cpu",
                            generator=torch.Generator().manual_seed(1))
        with progress.step(f"tracing {where} and building its rank programs",
                           f"built {_mesh_size(args.mesh)} rank programs"):
            pm = fxshard.parallelize(model, mesh, example_inputs=(ids,), **options)
    try:
        if args.command == "generate":
            return _generate(args, pm, model, ids, rank, progress, where)
        return _show(args, pm, model, ids, rank, progress)
    finally:
        # release fxshard's backend, then the process groups, before the interpreter exits:
        # gloo groups torn down at interpreter shutdown can abort a finished run
        pm.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _mesh_text(mesh: tuple[tuple[int, ...], tuple[str, ...]]) -> str:
    shape, names = mesh
    return "(" + ", ".join(f"{n}={k}" for n, k in zip(names, shape)) + ")"


def _mesh_size(mesh: tuple[tuple[int, ...], tuple[str, ...]]) -> int:
    """The number of ranks of a parsed ``--mesh``."""
    size = 1
    for k in mesh[0]:
        size *= k
    return size


def greedy_reference(model, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """The single-device model's greedy tokens: a plain loop, the whole sequence every step
    (no cache), ``[B, S + new_tokens]``."""
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(ids)
            logits = logits if isinstance(logits, torch.Tensor) else logits.logits
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def _generate(args, pm, model, ids: torch.Tensor, rank: int, progress: _Progress,
              where: str) -> int:
    say = print if rank == 0 else (lambda *a, **k: None)
    with progress.step(f"tracing {where} for generation and building its prefill and decode "
                       f"programs (the first pm.generate)",
                       f"built {pm.spec.world_size} ranks' prefill and decode programs and "
                       f"generated {args.new_tokens} tokens"):
        pm.generate(ids, max_new_tokens=args.new_tokens)
    with progress.step("timing the prefill and the decode steps"):
        start = time.perf_counter()
        pm.generate(ids, max_new_tokens=1)                 # prefill and the first token only
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        got = pm.generate(ids, max_new_tokens=args.new_tokens)
        total_s = time.perf_counter() - start
    with progress.step(f"the single-device reference: {args.new_tokens} greedy steps without "
                       f"a cache"):
        want = greedy_reference(model, ids, args.new_tokens)
    say(f"{_ran_on(pm)}")
    say(f"prompt: {args.batch} x {args.prompt_len} tokens (seed {args.seed}), "
        f"{args.new_tokens} new tokens per sequence, greedy")
    for b in range(args.batch):
        say(f"  sequence {b}: {got[b, args.prompt_len:].tolist()}")
    same = torch.equal(got, want)
    say(f"tokens equal the single-device model's greedy tokens: "
        f"{'yes' if same else 'NO'}")
    if not same:
        for b in range(args.batch):
            say(f"  single device {b}: {want[b, args.prompt_len:].tolist()}")
    steps = args.new_tokens - 1  # the first new token comes from the prefill
    decode_s = max(total_s - prefill_s, 0.0)
    say(f"prefill: {prefill_s * 1e3:.1f} ms for {args.batch} x {args.prompt_len} tokens")
    if steps:
        say(f"decode: {steps} steps, {decode_s / steps * 1e3:.2f} ms per step, "
            f"{args.batch * steps / decode_s:.1f} tokens/s (batch {args.batch})")
    return 0 if same else 1


def _show(args, pm, model, ids, rank: int, progress: _Progress) -> int:
    say = print if rank == 0 else (lambda *a, **k: None)
    ok = True
    if args.command == "demo":  # the verdict first, then the (long) plan
        with progress.step("running the mesh and the single-device model"), torch.no_grad():
            want = model(ids)
            got = pm(ids)
        err = (got - want).abs().max().item()
        ok = err < TOLERANCE
        say(f"{_ran_on(pm)}")
        say(f"max |parallel - single device| = {err:.3g} on mesh {pm.spec.describe()}: "
            f"{'PASS' if ok else 'FAIL'} (tolerance {TOLERANCE:g}, fp32)\n")
    say(pm.explain())
    if args.svg and rank == 0:
        with progress.step(f"drawing the plan to {args.svg}"):
            pm.explain().save(args.svg)
        say(f"\nplan drawn to {args.svg}")
    if args.command == "explain":
        return 0
    excerpt = layer_excerpt(pm.rank_module(rank).code)
    say(f"\nOne layer of rank {rank}'s program ({len(excerpt)} lines"
        f"{f', first {args.lines}' if len(excerpt) > args.lines else ''}):")
    say("\n".join(excerpt[:args.lines]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
