"""Mixed precision (`llmq quantize --target-bpw B`, or `--max-size S`, which derives B from a file size): each unit
of linears gets one scheme, chosen from its measured sensitivity so that the model's KLD at that size is as low as the
measurements say it can be: 4, 8 or 16 integer bits, or with `--for ENGINE` any scheme of the catalogue that engine
loads (schemes.py: 16-bit, FP8, INT8, INT5, INT4, NVFP4, MXFP4, all weight-only).

A unit is the linears one input feeds and engines fuse into one matmul (q/k/v, gate/up), or o_proj / down_proj
alone: vLLM loads a fused layer with one scheme (vllm#47215), and AWQ scales exactly these groups, so a unit has one
scheme. Its sensitivity is measured, not guessed: the mean KLD of the model's next-token distributions when that
unit alone is rounded to INT4 (RTN, the options' group size), on calibration windows (never the probe's held-out
text). On SmolLM2-135M the single-layer KLDs add up to the KLD of rounding all of them (0.48 summed, 0.47 at once),
so the KLD of a choice is estimated as the sum of its units' losses, and choosing is a knapsack: minimise the summed
loss under the byte budget, solved exactly by dynamic programming over budget buckets. The 4- and 5-bit schemes
(INT4, and with --for INT5, NVFP4 and MXFP4) are each measured that way; an 8-bit scheme's loss is the unit's INT4
loss scaled by the ratio of the two schemes' summed squared weight errors (KLD is quadratic in a small
perturbation); at 16 bits it is 0. The ratio cannot stand in for the FP4 measurements: on SmolLM2
(benchmarks/mixed_scheme_sensitivity.py, the 12 units of layers 2 / 14 / 27) NVFP4's measured KLD was 0.33-1.26x
INT4 g64's (below it in 10 units) while the MSE ratio put it at 1.0-1.2x (after INT4 in 11), and MXFP4's 0.58-2.8x
against an estimated 1.6-1.8x; the 8-bit estimates were 0.8-1.8x the measured INT8 KLD and kept INT8 ahead of FP8 in
all 12, as measured. B counts every byte of the decoder layers' linears (values, scales, zero points, global scales)
per weight; the embedding and lm_head are outside it (`--embedding` / `--lm-head` decide them).

The measurement streams like the quantizer: the float model's hidden states entering each layer are kept (tokens x
hidden per layer), and each layer's units are measured by running the later layers, read from the checkpoint one at
a time, on the perturbed states: O(layers^2) layer passes, one layer's weights in memory at a time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ...errors import LlmqError
from ...models import ModelSpec, qformat
from ...options import parse_size
from . import schemes
from .calib import TokenWindows
from .schemes import SCHEMES, Scheme, linear_bytes
from .streamed import (
    capped,
    capture_layer0,
    drop,
    head_name,
    load,
    logits,
    progress_bar,
    skeleton,
    source_tensors,
    stored_dtype,
)

SENSITIVITY_TOKENS = 1024   # calibration tokens the sensitivity pass scores (its cost is linear in them)
HEADER_BYTES_PER_ENTRY = 256  # above any safetensors header entry (name, dtype, shape, offsets) of a Llama tensor
BUCKETS = 1 << 20           # most budget steps the knapsack tracks (beyond: costs rounded up, the budget still holds)
MEASURED = "int4"           # the scheme whose loss is measured; the others' are scaled from it by weight MSE


def unit_shapes(spec: ModelSpec) -> list[list[tuple[int, int]]]:
    """[out, in] of each linear of each unit, in the family's Arch.units order."""
    return [[spec.linear_shape(r) for r in unit] for unit in spec.arch.unit_roles(spec.num_experts)]


def unit_keys(spec: ModelSpec) -> list[tuple[int, int]]:
    """(layer, unit) of every unit the model has (ModelSpec.units): the rows of the choice's arrays."""
    return [(i, u) for i in range(spec.num_layers) for u in spec.units(i)]


def candidates(spec: ModelSpec, opts) -> list[Scheme]:
    """The schemes this run chooses among (schemes.candidates for the model's decoder linears), cheapest first."""
    return schemes.candidates(opts.for_engine, [s for unit in unit_shapes(spec) for s in unit], opts)


def choose(losses: np.ndarray, costs: np.ndarray, budget: int) -> list[int]:
    """Per item, the index of the option that minimises the summed loss with summed cost <= budget. losses / costs:
    [items, options], costs in whole bytes. Exact in steps of the costs' greatest common divisor (a real model's unit
    costs share a large one: 384 bytes for SmolLM2) when the budget spans at most BUCKETS of them; otherwise in steps
    of budget / BUCKETS with costs rounded up. An LlmqError if even the cheapest options exceed the budget."""
    if costs.min(1).sum() > budget:
        raise LlmqError("the budget is below the smallest choice")
    step = int(np.gcd.reduce(costs.astype(np.int64).ravel()))
    unit = step if budget / step <= BUCKETS else budget / BUCKETS
    c = np.ceil(costs / unit - 1e-9).astype(np.int64)
    cap = int(budget // unit)
    best = np.full(cap + 1, np.inf)
    best[0] = 0.0
    picks = np.zeros((len(losses), cap + 1), dtype=np.int8)
    for i in range(len(losses)):
        new = np.full(cap + 1, np.inf)
        for j in range(losses.shape[1]):
            if c[i, j] > cap:
                continue
            cand = np.full(cap + 1, np.inf)
            cand[c[i, j]:] = best[:cap + 1 - c[i, j]] + losses[i, j]
            better = cand < new
            new[better], picks[i, better] = cand[better], j
        best = new
    if not np.isfinite(best).any():  # bucket rounding can push the cheapest choice just past the budget
        raise LlmqError("the budget is below the smallest choice")
    at, out = int(np.argmin(best)), []
    for i in reversed(range(len(losses))):
        j = int(picks[i, at])
        out.append(j)
        at -= c[i, j]
    return out[::-1]


@dataclass
class Plan:
    """The scheme of every decoder linear (full name -> a schemes.SCHEMES name) and what the manifest records of the
    choice."""

    schemes: dict[str, str]
    manifest: dict

    @property
    def bits(self) -> dict[str, int]:
        """The linears on an integer grid or dense: name -> 4 / 8 / 16 (what the quantize method rounds)."""
        return {n: SCHEMES[s].bits for n, s in self.schemes.items() if SCHEMES[s].integer}

    @property
    def formats(self) -> dict[str, str]:
        """The linears in a floating-point format (fp8, nvfp4, mxfp4): name -> scheme."""
        return {n: s for n, s in self.schemes.items() if not SCHEMES[s].integer}

    @property
    def dense(self) -> list[str]:
        return sorted(n for n, s in self.schemes.items() if s == "16bit")


class _Scorer:
    """Mean KL(float || perturbed) of next-token distributions on the second half of every window (the positions
    with at least half a window of context, as llama-perplexity scores), against reference log-probabilities
    computed once."""

    def __init__(self, final: torch.Tensor, norm, head: torch.Tensor, softcap: float | None = None):
        from .probe import positions_per_chunk

        self.norm, self.head, self.softcap = norm, head, softcap
        self.chunk = positions_per_chunk(head.shape[0])
        self.ref = [lp.cpu() for lp in self._logprobs(final)]

    def _logprobs(self, h: torch.Tensor):
        h = h[:, h.shape[1] // 2:].reshape(-1, h.shape[-1])
        for i in range(0, h.shape[0], self.chunk):
            yield capped(logits(self.norm(h[i:i + self.chunk]), self.head), self.softcap).log_softmax(-1)

    def kld(self, h: torch.Tensor) -> float:
        total, n = 0.0, 0
        for ref, lq in zip(self.ref, self._logprobs(h)):
            ref = ref.to(lq.device)
            total += float((ref.exp() * (ref - lq)).sum(-1, dtype=torch.float64).sum())
            n += ref.shape[0]
        return total / n


@torch.no_grad()
def measure(model_dir, spec: ModelSpec, opts, windows: TokenWindows, device, progress: bool = True,
            cands: Sequence[Scheme] = (SCHEMES[MEASURED],), direct: tuple[str, ...] = (MEASURED,),
            layers: tuple[int, ...] | None = None) -> dict:
    """Per unit (layer, index into Arch.unit_roles: ModelSpec.units): "mse", each candidate's summed squared weight
    error, and "kld", the
    KLD of each scheme in `direct` with that unit alone rounded to it (but in no unit the engine refuses it in:
    refused_units). layers: only these layers' units (all by default; the later layers run all the same)."""

    arch, units = spec.arch, spec.arch.unit_paths(spec.num_experts)
    source = source_tensors(model_dir, spec, opts.rotate, opts.seed)
    dtype = stored_dtype(model_dir)
    model = skeleton(model_dir, arch, dtype, device)
    load(model.get_submodule(qformat.EMBEDDING), qformat.EMBEDDING, source, device)
    hidden, kws = capture_layer0(model, arch, windows.samples, device)
    kws = [k[0] for k in kws]   # the text windows' one set of layer arguments
    x = torch.cat(hidden)  # the windows as one batch: [windows, tokens, hidden]
    drop(model, qformat.EMBEDDING)
    stack = model.get_submodule(arch.layers)
    n = len(stack)
    chosen = range(n) if layers is None else layers
    streamed = [c for c in cands if c.name in direct and c.name != "16bit"]  # schemes whose KLD is measured ...
    skip = refused_units(spec, opts, cands)   # ... except in units the engine would not load them in
    measured = [[c for k, c in enumerate(cands) if c in streamed and not skip[u, k]] for u in range(len(units))]

    def layer(j: int):
        return load(stack[j], arch.prefix(j), source, device).to(dtype=torch.float32)

    entering = []
    with progress_bar(progress) as bar:
        task = bar.add_task("sensitivity: float pass", total=n)
        for j in range(n):
            entering.append(x.cpu())
            x = layer(j)(x, **kws[j])
            stack[j].to("meta")
            bar.advance(task)
        norm = load(model.get_submodule(arch.final_norm), arch.final_norm, source, device).to(dtype=torch.float32)
        scorer = _Scorer(x, norm, source[head_name(source)].to(device), spec.final_softcap)
        out: dict = {}
        task = bar.add_task("sensitivity: units", total=sum(n - i for i in chosen))
        for i in chosen:
            prefix = arch.prefix(i)
            lay = layer(i)
            h_in = entering[i].to(device)
            streams = []
            for u in spec.units(i):
                lins = [lay.get_submodule(nm) for nm in units[u]]
                kept = [lin.weight.data for lin in lins]
                mse = {}
                for scheme in cands:
                    if scheme.name == "16bit":
                        mse[scheme.name] = 0.0
                        continue
                    deq = [qw.dequantize().to(device) for qw in scheme.quantize_unit(kept, opts, dtype)]
                    mse[scheme.name] = float(sum((d - w).pow(2).sum() for d, w in zip(deq, kept)))
                    if scheme in measured[u]:
                        for lin, d in zip(lins, deq):
                            lin.weight.data = d
                        streams.append(lay(h_in, **kws[i]))
                for lin, w in zip(lins, kept):
                    lin.weight.data = w
                out[(i, u)] = {"prefix": prefix, "mse": mse}
            stack[i].to("meta")
            bar.advance(task)
            s = torch.cat(streams)  # every perturbed state of the layer in one batch through the later layers
            for j in range(i + 1, n):
                s = layer(j)(s, **kws[j])
                stack[j].to("meta")
                bar.advance(task)
            per_unit = iter(s.chunk(len(streams)))
            for u in spec.units(i):
                out[(i, u)]["kld"] = {sc.name: scorer.kld(next(per_unit)) for sc in measured[u]}
    return out


def losses(sens: dict, keys: list, cands: list[Scheme]) -> np.ndarray:
    """[units, candidates] estimated KLD of each unit in each scheme: the measured one where there is one, else the
    measured INT4 loss scaled by the ratio of the two schemes' weight MSEs (KLD is quadratic in a small
    perturbation); 16bit costs nothing."""
    def loss(m: dict, name: str) -> float:
        if name in m["kld"]:
            return m["kld"][name]
        base = m["mse"][MEASURED]
        return m["kld"][MEASURED] * m["mse"][name] / base if base else 0.0

    return np.array([[loss(sens[k], c.name) for c in cands] for k in keys])


def refused_units(spec: ModelSpec, opts, cands) -> np.ndarray:
    """[units of a layer, candidates] True where the engine loads the scheme but not in that unit
    (Scheme.loads_unit)."""
    return np.array([[opts.for_engine is not None and not c.loads_unit(opts.for_engine, spec.arch, roles)
                      for c in cands] for roles in spec.arch.unit_roles(spec.num_experts)], dtype=bool)


def refused(spec: ModelSpec, opts, cands: list[Scheme]) -> np.ndarray:
    """refused_units of every unit: [unit_keys, candidates]."""
    return refused_units(spec, opts, cands)[[u for _, u in unit_keys(spec)]]


def unit_costs(spec: ModelSpec, opts, cands: list[Scheme], dtype_bytes: int) -> tuple[np.ndarray, int]:
    """([unit_keys, candidates] bytes of each unit in each scheme, parameters of all decoder linears); in the
    GGUF file's blocks with --size-in gguf. dtype_bytes: the checkpoint's stored dtype's (scales and dense linears
    keep it: a float32 checkpoint's dense units take twice a bf16 one's)."""
    shapes = unit_shapes(spec)

    def cost(n: int, k: int, scheme: Scheme) -> int:
        return scheme.gguf_bytes(n, k, opts) if opts.size_in == "gguf" else \
            scheme.checkpoint_bytes(n, k, opts, dtype_bytes)

    costs = np.array([[sum(cost(n, k, c) for n, k in shapes[u]) for c in cands] for _, u in unit_keys(spec)],
                     dtype=np.float64)
    return costs, decoder_params(spec)


def decoder_params(spec: ModelSpec) -> int:
    """Parameters of all decoder linears the choice prices (what --target-bpw is per)."""
    shapes = unit_shapes(spec)
    return sum(n * k for _, u in unit_keys(spec) for n, k in shapes[u])


def bpw_for_size(model_dir, spec: ModelSpec, opts) -> float:
    """The --target-bpw that fills a --max-size file: the bytes left once every tensor outside the decoder linears
    is priced as it will be stored (an INT8 table or head: a byte per weight and a scale per row or group), less each
    linear's 16-byte weight_shape and an upper bound on the safetensors header, per decoder-linear weight. With
    --size-in gguf, what the GGUF file holds besides the decoder linears' blocks (targets.gguf_size)."""
    if opts.size_in == "gguf":
        from ..targets.gguf_size import fixed_bytes

        fixed = fixed_bytes(model_dir, opts.embedding == "int8", opts.lm_head == "int8", opts.rotate != "none")
        return (parse_size(opts.max_size) - fixed) * 8 / decoder_params(spec)
    from ...models.checkpoint import safetensors_files
    from ...models.reader import LazyTensors

    tensors = LazyTensors(safetensors_files(model_dir))
    linears = {f"{spec.arch.prefix(i)}.{p}.weight" for i in range(spec.num_layers)
               for p in spec.stored_linears(i).values()} - {f"{r}.weight" for r in spec.kept_16bit()}
    # a stacked MoE's tensors (Experts.stacked) -> how many per-expert tensors each is stored as (its weights are
    # decoder linears, its biases stay 16-bit)
    stacked = spec.arch.moe.stacked_paths() if spec.stacked_experts() else {}
    parts = {f"{spec.arch.prefix(i)}.{p}": spec.num_experts * len(roles)
             for i in range(spec.num_layers) for p, roles in stacked.items()}
    linears |= {n for n in parts if not n.endswith("_bias")}
    table, head = f"{qformat.EMBEDDING}.weight", f"{qformat.LM_HEAD}.weight"
    int8 = {table: opts.embedding == "int8", head: opts.lm_head == "int8"}

    def int8_rows(name: str) -> int:  # packed integers, a scale per row (stored dtype), weight_shape
        dtype, (rows, cols) = tensors.info(name)
        return linear_bytes(rows, cols, 8, opts.int8_group_size, True, dtype.itemsize) + 16

    fixed, entries = 0, 0
    for name in tensors:
        dtype, shape = tensors.info(name)
        if name in linears:
            entries += 4 * parts.get(name, 1)   # packed integers, scales, shape, zero points
            continue
        fixed += int8_rows(name) if int8.get(name) else math.prod(shape) * dtype.itemsize
        entries += 3 if int8.get(name) else parts.get(name, 1)
    # untied: for an INT8 head beside a 16-bit table, or by --rotate (the head is no longer the table)
    if head not in tensors and (opts.rotate != "none" or (opts.lm_head == "int8" and opts.embedding != "int8")):
        dtype, shape = tensors.info(table)
        fixed += int8_rows(table) if opts.lm_head == "int8" else math.prod(shape) * dtype.itemsize
        entries += 3 if opts.lm_head == "int8" else 1
    shapes = sum(parts.get(n, 1) for n in linears)   # a weight_shape each
    left = parse_size(opts.max_size) - fixed - 16 * shapes - HEADER_BYTES_PER_ENTRY * entries
    return left * 8 / decoder_params(spec)


def check(spec: ModelSpec, opts, dtype_bytes: int) -> tuple[np.ndarray, int]:
    """unit_costs(spec, opts, candidates(spec, opts), dtype_bytes), after an LlmqError when opts.target_bpw is below
    what every unit in its cheapest candidate takes."""
    cands = candidates(spec, opts)
    costs, params = unit_costs(spec, opts, cands, dtype_bytes)
    least = np.where(refused(spec, opts, cands), np.inf, costs).min(1).sum()
    floor = least * 8 / params
    if opts.target_bpw * params / 8 < least:
        asked = (f"--max-size {opts.max_size} leaves {opts.target_bpw:.3f} bits per decoder weight, which is"
                 if opts.max_size is not None else f"--target-bpw {opts.target_bpw:g} is")
        cheapest = (f"{opts.bits}-bit groups of {opts.group_size or 'a row'}" if opts.for_engine is None else
                    f"the cheapest schemes {opts.for_engine} loads")
        raise LlmqError(f"{asked} below the {floor:.3f} bits per weight that {cheapest} take; ask for at least that")
    return costs, params


def plan(model_dir, spec: ModelSpec, opts, calib: TokenWindows, device, progress: bool = True) -> Plan:
    """Measure every unit's sensitivity and choose its scheme so the decoder linears fit opts.target_bpw."""
    costs, params = check(spec, opts, stored_dtype(model_dir).itemsize)
    cands = candidates(spec, opts)
    budget = opts.target_bpw * params / 8
    take = max(1, SENSITIVITY_TOKENS // len(calib.samples[0]))
    windows = calib.head(take)
    direct = tuple(c.name for c in cands if c.bits in (4, 5))   # measured, not estimated (module doc)
    sens = measure(model_dir, spec, opts, windows, device, progress, cands, direct)
    units = spec.arch.unit_paths(spec.num_experts)
    keys = unit_keys(spec)
    loss = np.where(refused(spec, opts, cands), np.inf, losses(sens, keys, cands))   # never chosen
    picks = choose(loss, costs, int(budget))
    chosen_schemes, chosen_units = {}, []
    for (i, u), j in zip(keys, picks):
        prefix, name = sens[(i, u)]["prefix"], cands[j].name
        chosen_schemes.update({f"{prefix}.{m}": name for m in units[u]})
        mse = sens[(i, u)]["mse"]
        chosen_units.append({"layer": i, "modules": list(units[u]), "scheme": name, "bits": cands[j].bits,
                             "kld_alone": {k: round(v, 7) for k, v in sens[(i, u)]["kld"].items()},
                             "mse_ratio_to_int4": {c.name: mse[c.name] / mse[MEASURED] if mse[MEASURED] else 0.0
                                                   for c in cands if c.name not in (*direct, "16bit")}})
    chosen = sum(costs[n, j] for n, j in enumerate(picks))
    at_int4 = [c.name for c in cands].index(MEASURED)
    manifest = {
        "target_bpw": opts.target_bpw, "for": opts.for_engine, "candidates": [c.name for c in cands],
        "bpw": round(chosen * 8 / params, 4), "bytes": int(chosen), "budget_bytes": int(budget), "params": params,
        "estimated_kld": round(float(sum(loss[n, j] for n, j in enumerate(picks))), 6),
        "estimated_kld_all_int4": round(float(loss[:, at_int4].sum()), 6),
        "count": {c.name: sum(1 for j in picks if cands[j] is c) for c in cands},
        "sensitivity": {"method": "rtn", "measured": list(direct), "group_size": opts.group_size,
                        "tokens": windows.tokens, "windows": len(windows.samples), "source": windows.source,
                        "others": "the measured INT4 KLD x the ratio of the schemes' weight MSEs"},
        "units": chosen_units,
    }
    return Plan(chosen_schemes, manifest)
