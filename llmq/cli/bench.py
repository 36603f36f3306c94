"""`llmq bench serve|offline|hw|compare`: load-test an OpenAI-compatible endpoint, sweep the bundled engine
offline, probe the hardware, or compare two reports."""

from __future__ import annotations

import click

from ..bench.offline import OfflineOptions
from ..errors import LlmqError
from ..models import source_artifact
from .common import echo_json, get_store
from .options import stage_command


def _ints(text: str | None, what: str) -> list[int]:
    if not text:
        return []
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise LlmqError(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise LlmqError(f"{what}: values must be positive integers, got {text!r}")
    return vals


def _rates(text: str | None) -> list[float]:
    if not text:
        return []
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise LlmqError(f"--request-rate: expected comma-separated numbers (or inf), got {text!r}") from None
    if not vals or any(not v > 0 for v in vals):  # NaN is not > 0 either
        raise LlmqError(f"--request-rate: rates must be > 0, got {text!r}")
    return vals


def _range(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    lo, sep, hi = text.partition(":")
    try:
        return int(lo), int(hi)
    except ValueError:
        raise LlmqError(f"--input-len-range: expected LOW:HIGH, got {text!r}") from None


def _console():
    from rich.console import Console

    return Console(width=max(Console().width, 140))


def _warn(msg: str) -> None:
    click.echo(f"warning: {msg}", err=True)


class BenchGroup(click.Group):
    """`llmq bench serve|offline|hw|compare`. The spellings from before the subcommands still work:
    `bench --endpoint URL ...` is `bench serve --endpoint URL ...`, `bench --engine REF ...` is
    `bench offline REF ...` and `bench --hw ...` is `bench hw ...`."""

    def parse_args(self, ctx, args):
        if args and args[0].startswith("--") and args[0] != "--help":
            args = _subcommand_for(args)
        return super().parse_args(ctx, args)


def _subcommand_for(args: list[str]) -> list[str]:
    flags = [a.split("=", 1)[0] for a in args]
    modes = [m for m in ("--endpoint", "--engine", "--hw") if m in flags]
    if len(modes) != 1:
        raise LlmqError("give exactly one of --endpoint URL, --engine REF or --hw" +
                        (f" (got {', '.join(modes)})" if modes else "") + "; or use `llmq bench serve|offline|hw`")
    if modes[0] == "--endpoint":
        return ["serve", *args]
    if modes[0] == "--hw":
        return ["hw", *(a for a in args if a != "--hw")]
    i = flags.index("--engine")
    if "=" in args[i]:
        ref, rest = [args[i].split("=", 1)[1]], args[i + 1:]
    else:
        ref, rest = args[i + 1:i + 2], args[i + 2:]
    return ["offline", *ref, *args[:i], *rest]


@click.group("bench", cls=BenchGroup)
def bench():
    """Benchmark an OpenAI-compatible endpoint (serve), the bundled engine in-process (offline) or this machine
    (hw); compare two reports (compare)."""


@bench.command("serve")
@click.option("--endpoint", metavar="URL", required=True,
              help="OpenAI-compatible server to load-test, e.g. http://127.0.0.1:8000.")
@click.option("--model", help="Model id to request (default: the only model the endpoint serves).")
@click.option("--api", type=click.Choice(["completions", "chat"]), default="completions", show_default=True)
@click.option("--concurrency", metavar="N,...", help="Closed-loop levels: clients in flight, e.g. 1,8,32.")
@click.option("--request-rate", metavar="R,...",
              help="Open-loop levels: Poisson arrivals per second (inf: all at once).")
@click.option("--num-prompts", type=int, default=64, show_default=True, help="Requests per level (at most).")
@click.option("--input-len", type=int, default=128, show_default=True, help="Prompt tokens (synthetic prompts).")
@click.option("--input-len-std", type=float, default=0.0, help="Normal spread of prompt lengths (tokens).")
@click.option("--input-len-range", metavar="LOW:HIGH", help="Uniform prompt lengths instead of --input-len.")
@click.option("--output-len", type=int, default=128, show_default=True, help="max_tokens per request.")
@click.option("--dataset", type=click.Path(dir_okay=False),
              help="JSONL prompts: {\"prompt\": ..., \"output_len\": ...}.")
@click.option("--tokenizer", metavar="REF", help="Tokenizer (directory or artifact) for exact prompt lengths "
              "(default: the served llmq model's).")
@click.option("--slo-ttft-ms", type=float, help="TTFT SLO for goodput (ms).")
@click.option("--slo-tpot-ms", type=float, help="TPOT SLO for goodput (ms).")
@click.option("--cost-per-hour", type=float, help="Price of the server in $/hour, for $ per 1M output tokens.")
@click.option("--time-limit", type=float, default=300.0, show_default=True, help="Seconds per level (hard stop).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds prompts and Poisson arrivals.")
@click.option("--warmup", type=int, default=1, show_default=True,
              help="Requests sent (not recorded) before the first level.")
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--no-ignore-eos", is_flag=True, help="Do not send ignore_eos (for servers that reject it).")
@click.option("--api-key", envvar="LLMQ_API_KEY", help="Bearer key for the endpoint (env LLMQ_API_KEY).")
@click.option("--name", help="Name of the bench-report artifact (default: bench-<model>).")
@click.option("--no-save", is_flag=True, help="Do not write a bench-report artifact.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
@click.pass_context
def serve(ctx, endpoint, model, api, concurrency, request_rate, num_prompts, input_len, input_len_std,
          input_len_range, output_len, dataset, tokenizer, slo_ttft_ms, slo_tpot_ms, cost_per_hour, time_limit, seed,
          warmup, temperature, no_ignore_eos, api_key, name, no_save, as_json):
    """Load-test an OpenAI-compatible endpoint (llmq, vLLM, TensorRT-LLM, llama.cpp) at each concurrency or
    request rate."""
    from ..bench import report as R
    from ..bench.online import OnlineSettings, parent_ids, run_online

    store = get_store(ctx)
    s = OnlineSettings(endpoint=endpoint, model=model, api=api, concurrency=_ints(concurrency, "--concurrency"),
                       request_rate=_rates(request_rate), num_prompts=num_prompts, input_len=input_len,
                       input_len_std=input_len_std, input_len_range=_range(input_len_range),
                       output_len=output_len, dataset=dataset, tokenizer=tokenizer, slo_ttft_ms=slo_ttft_ms,
                       slo_tpot_ms=slo_tpot_ms, cost_per_hour=cost_per_hour, time_limit=time_limit, seed=seed,
                       warmup=warmup, temperature=temperature, ignore_eos=not no_ignore_eos, api_key=api_key)

    def progress(lv):
        sm = lv["summary"]
        click.echo(f"{lv['label']}: {sm['completed']} ok, {sm['failed']} failed, {sm['cancelled']} cancelled "
                   f"in {sm['duration_s']:.1f} s", err=True)

    report, ep = run_online(s, store, _warn, progress)
    _print(report, None if no_save else R.save(store, report, name, parent_ids(ep, store)), as_json)


@stage_command("offline", OfflineOptions, "Print the results as JSON.", group=bench)
def offline(ctx, ref, opts, as_json):
    """Sweep REF (an engine, quantized or model artifact; default: the default model) in-process, one batch size
    at a time: decode step time, tokens/s, MBU and MFU."""
    from ..bench import report as R
    from ..bench.offline import run_offline

    store = get_store(ctx)
    art = run_offline(source_artifact(ref, store), opts, store,
                      progress=lambda r: click.echo(f"batch {r.batch_size}: {r.tokens_per_s:.1f} tok/s, "
                                                    f"step {r.step_ms:.1f} ms", err=True))
    report = R.load(store, str(art.path))
    for note in report["settings"].get("notes", []):
        click.echo(f"note: {note}", err=True)
    _print(report, art, as_json)


@bench.command("hw")
@click.option("--device", default=None, help="Device to measure (default: cuda when available).")
@click.option("--refresh", is_flag=True, help="Measure again instead of using the cached figures.")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON.")
def hw(device, refresh, as_json):
    """Measure (once, cached per machine) memory read bandwidth and matmul peaks, and print them."""
    from ..bench.hw import hardware

    h = hardware(device, refresh=refresh)
    if as_json:
        echo_json(h)
        return
    load = h.get("load_per_core")
    click.echo(f"{h['machine']}  ({h['device']}, measured {h['measured']}"
               f"{'' if load is None else f' at load {load:.2f} per core'})\n"
               f"  memory read bandwidth  {h['read_bandwidth'] / 1e9:8.2f} GB/s\n"
               f"  fp32 matmul            {h['fp32_flops'] / 1e9:8.2f} GFLOP/s\n"
               f"  bf16 matmul            {h['bf16_flops'] / 1e9:8.2f} GFLOP/s")


def _print(report: dict, art, as_json: bool) -> None:
    """A report as a table (or JSON without the per-request timings, which stay in the report file)."""
    from ..bench import report as R

    if as_json:
        if "levels" in report:
            report = dict(report, levels=[{k: v for k, v in lv.items() if k != "requests"} for lv in report["levels"]])
        echo_json(dict(report, artifact=None if art is None else str(art.path)))
        return
    _console().print(R.table(report))
    if art is not None:
        click.echo(f"report: {art.ref}  ({art.path}; plot: {art.file('plot.png')})")


@bench.command("compare")
@click.argument("a")
@click.argument("b")
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON.")
@click.pass_context
def compare(ctx, a, b, as_json):
    """Key metrics of bench reports A and B (artifact refs or report.json paths) with ratios B/A."""
    from ..bench import compare as C
    from ..bench import report as R

    store = get_store(ctx)
    result = C.compare(R.load(store, a), R.load(store, b))
    if as_json:
        echo_json(result)
        return
    _console().print(C.table(result, a, b))
    for side, labels in (("A", result["only_a"]), ("B", result["only_b"])):
        if labels:
            click.echo(f"only in {side}: {', '.join(labels)}")
    for key, (va, vb) in result["settings_differ"].items():
        _warn(f"the reports differ in {key}: A {va!r}, B {vb!r}")
