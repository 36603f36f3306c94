"""The quantize stage's options, declared once for the command line and recipes: the fields every method shares,
then each method's own (methods.py), and what the user's spelling resolves to."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...errors import LlmqError
from ...options import Options, add_fields, default_of, option, parse_size
from .methods import METHODS, METHODS_HELP, WEIGHT_ONLY, load_method, method_options

if TYPE_CHECKING:   # what add_fields composes in at run time, as bases a type checker reads
    from .methods import AutoRoundOptions, FP4Options, LLMInt8Options, NF4Options, SmoothQuantOptions

    class _MethodFields(FP4Options, SmoothQuantOptions, NF4Options, LLMInt8Options, AutoRoundOptions):
        pass
else:
    _MethodFields = object

ENGINES = ("llmq", "vllm", "trtllm", "gguf")   # what --for names (schemes.py: which scheme each loads); here, not
#                                               there, so `--help` imports no torch

ACTIVATION_SCHEMES = ("dynamic", "static")
DEFAULT_GROUPS = (128, 64, 32)
LM_HEAD_CHOICES = ("keep", "int8")
EMBEDDING_CHOICES = ("keep", "int8")
THINKING = ("auto", "on", "off")
ROTATIONS = ("none", "hadamard")   # --rotate (rotation.py folds them); here, not there, so `--help` imports no torch
SCALE_RULES = ("search", "amax")
FP4_SEARCHED = ("nvfp4", "mxfp4")  # FP4 methods whose --scales search is opt-in (default: amax, compressed-tensors')
GRIDS = ("int", "q4_k", "iq4_xs")   # int, then GGML's (qweight.GGML_WEIGHTS); here, so `--help` imports no torch
# a --grid -> the GGML grid of 32-weight blocks that llama.cpp writes for it where 256 does not divide a row
# (llama-quant.cpp's tensor_type_fallback); Q4_K's there, Q5_0, is not llmq's: INT4 asymmetric groups of 32 instead
GRID_FALLBACK = {"iq4_xs": "iq4_nl"}
GRID_METHODS = ("rtn", "gptq")  # the methods that quantize onto GGML's grids


@dataclass(frozen=True)
@add_fields(*method_options())
class QuantizeOptions(Options, _MethodFields):
    """What `llmq quantize` (or a recipe's quantize stage) asks for. group_size: None = the default for the bit width
    (at 4 or 5 bits the largest of 128 / 64 / 32 that divides every linear's input features, e.g. 64 for SmolLM2's 576;
    per channel at 8 bits), 0 or -1 = per output channel, N = groups of N input columns. `resolved()` turns the
    user's spelling into the canonical one (group_size >= 0, 0 = per channel; a method's own options left unset at what
    they mean for it) that methods read. The fields below are every method's; each method's own (GPTQ's --act-order,
    SmoothQuant's --alpha, ...) are declared in methods.py and added after them."""

    bits: int | None = option(None, "Weight bits: 4, 5 or 8 (default: 8, or the only width the method has). 5 bits "
                              "(rtn / gptq / awq) are GGUF's Q5_0 / Q5_1: llmq's runtime and llama.cpp run them, "
                              "vLLM / SGLang / TensorRT-LLM do not.", choices=(4, 5, 8))
    method: str = option("rtn", METHODS_HELP, choices=tuple(METHODS))
    group_size: int | None = option(None, "Input columns per scale; 0 or -1 = per output channel. Default: at 4 / 5 "
                                    "bits the largest of 128 / 64 / 32 dividing every linear's input features (64 for "
                                    "SmolLM2), per channel at 8 bits; bnb-nf4: its block size, default 64.")
    symmetric: bool = option(True, "Symmetric or zero-point grid.", flag="--sym/--asym")
    scales: str | None = option(None, "Integer scales (rtn / gptq / awq): search = per group the scale with the "
                                "least squared rounding error over the whole signed grid, weighted by calibration "
                                "statistics where the method has them; amax = max|w| / qmax (compressed-tensors' "
                                "observer rule). Default: search. nvfp4 / mxfp4: search = each block's scale among "
                                "amax's and its neighbours on the scale grid; default amax (compressed-tensors').",
                                choices=SCALE_RULES)
    grid: str = option("int", "4-bit grid (rtn / gptq): int = compressed-tensors' integer groups; q4_k = GGML's Q4_K "
                       "(256-weight super-blocks, 6-bit sub-block scales and mins); iq4_xs = GGML's IQ4_XS (4.25 "
                       "bits: a 16-value non-uniform table, 6-bit signed sub-block scales); written to GGUF as that "
                       "type bit for bit. Linears whose input width is not a multiple of 256 (SmolLM2's 576) fall "
                       "back: iq4_xs's to GGML's IQ4_NL (its table, an fp16 step per 32 weights; llama.cpp's "
                       "fallback), q4_k's to INT4 asymmetric groups of 32 (GGUF Q4_1; llama.cpp's is Q5_0), as do "
                       "iq4_xs's where 32 does not divide the width either.", choices=GRIDS)
    per_tensor: bool = option(False, "One scale per weight tensor (rtn, smoothquant, fp8; gptq and awq refuse it).")
    activations: str = option("dynamic", "W8A8 / FP8: per-token activation scales at run time, or static ones from "
                              "calibration.", choices=ACTIVATION_SCHEMES)
    calib: str | None = option(None, "Calibration data: .txt / .jsonl file (rows {\"text\"} or {\"messages\"}), "
                               "directory, or dataset name (network). Default: bundled offline chat, prose and code.",
                               metavar="DATA")
    chat_template: bool = option(True, "Render calibration conversations through the model's chat template (plain "
                                 "'role: text' turns without one).", flag="--chat-template/--no-chat-template")
    thinking: str = option("auto", "Thinking in calibration conversations, for a chat template with an "
                           "enable_thinking switch: auto = where a conversation carries reasoning; on / off = all.",
                           choices=THINKING)
    num_samples: int = option(32, "Calibration windows.", ge=1, aliases=("calib_samples",))
    seq_len: int = option(256, "Tokens per calibration window.", ge=2)
    image_share: float | None = option(None, "Share of the calibration samples that are generated image + question "
                                       "conversations (vision-language models; default 0.25 there; 0: text only).",
                                       ge=0, lt=1)
    seed: int = option(0, "Seed for choosing calibration windows (and --rotate's random signs).")
    probe_tokens: int = option(2048, "Held-out tokens for the KLD / top-1 quality probe (0: skip it).", ge=0)
    rotate: str = option("none", "Rotate the residual stream before quantizing: hadamard = a random Hadamard matrix "
                         "(QuaRot / SpinQuant's R1) folded into the embedding, the norms' gains, every linear reading "
                         "or writing the stream and the head, so the 16-bit model computes the same function while "
                         "outlier channels spread over all; engines run it unchanged (a tied head is stored apart).",
                         choices=ROTATIONS)
    lm_head: str = option("keep", "Output projection: keep it as stored (16-bit), or int8 per output channel (RTN, "
                          "probed with the rest; weight-only methods). It is the widest matrix a decode step reads; "
                          "a tied model gets its own lm_head, the embedding table stays 16-bit.",
                          choices=LM_HEAD_CHOICES)
    embedding: str = option("keep", "Token embedding table: keep it as stored (16-bit), or int8 per row (RTN, probed "
                            "with the rest; weight-only methods). A tied model's head is then that same INT8 table, "
                            "as in llama.cpp's Q8_0 token_embd: half the bytes of SmolLM2's file are its embedding. "
                            "Runs in llmq's runtime and exports to GGUF; transformers and TensorRT-LLM cannot load "
                            "a quantized embedding.", choices=EMBEDDING_CHOICES)
    target_bpw: float | None = option(None, "Mixed precision: give each decoder unit (q/k/v, o, gate/up, down) 4, 8 "
                                      "or 16 bits from its measured sensitivity so that the decoder linears average "
                                      "at most this many bits per weight, scales included (rtn / gptq / awq at 4 "
                                      "bits).", gt=4, le=16, metavar="BPW")
    max_size: str | None = option(None, "Mixed precision for a file-size budget (e.g. 105MB, 100MiB): the "
                                  "--target-bpw that what is left fills, once the embedding, head, norms and headers "
                                  "are priced as they will be stored; the file is at most this size.", metavar="SIZE")
    for_engine: str | None = option(None, "Mixed precision across formats: choose each unit's scheme among every one "
                                    "ENGINE loads (16-bit, FP8, INT8, INT5 in groups of 32, INT4, NVFP4 and MXFP4 "
                                    "weight-only; vllm: all but INT5; trtllm: 16-bit, INT8 per channel, INT4; gguf: "
                                    "all but FP8; llmq: all). The "
                                    "method rounds the integer units; FP8 / NVFP4 / MXFP4 ones are rounded to "
                                    "nearest. Without it, --target-bpw / --max-size choose among 4, 8 and 16 integer "
                                    "bits.",
                                    choices=ENGINES, flag="--for", metavar="ENGINE")
    size_in: str = option("checkpoint", "Whose bytes --target-bpw / --max-size count: the checkpoint's, or the "
                          "GGUF file's that `llmq build --target gguf` will write (Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 "
                          "blocks of 18 / 20 / 22 / 24 / 34 bytes per 32 weights, norms in float32, the tokenizer "
                          "in its metadata), so a --max-size holds for the .gguf.", choices=("checkpoint", "gguf"))
    int8_group_size: int = option(0, "Input columns per scale of the 8-bit weights that --target-bpw / --max-size, "
                                  "--embedding int8 and --lm-head int8 make: 0 = per output channel (what TensorRT-LLM "
                                  "loads), 32 = llama.cpp's Q8_0 block, which the GGUF target then stores exactly "
                                  "instead of repeating a row's scale in every block.", ge=0)
    ignore: tuple[str, ...] = option(("lm_head",), internal=True)
    name: str | None = option(None, "Artifact name (default: <model>-<method>-w<bits>[g<group>]).")
    device: str | None = option(None, "Device to calibrate on (default: cuda when available, else cpu).")

    def check(self) -> None:
        """Every rule that needs neither the model nor its weights."""
        if self.bits not in (None, 4, 5, 8):
            raise LlmqError(f"--bits must be 4, 5 or 8, got {self.bits}")
        super().check()
        method = load_method(self.method)
        if self.bits is not None and self.bits not in method.bits:
            widths = " or ".join(map(str, method.bits))
            raise LlmqError(f"method {self.method} quantizes to {widths} bits, not {self.bits} (it supports {widths} "
                            "bits only)")
        if self.grid != "int":
            if self.method not in GRID_METHODS or self.bits not in (None, 4) or self.per_tensor or self.mixed \
                    or self.group_size not in (None, 32):
                raise LlmqError(f"--grid {self.grid} is 4-bit rtn or gptq with its own 32-weight sub-blocks: drop "
                                "--bits / --group-size / --per-tensor / --target-bpw / --max-size, and use --method "
                                "rtn or gptq")
        if self.scales is not None and self.method not in WEIGHT_ONLY + FP4_SEARCHED:
            raise LlmqError(f"--scales is the scale rule of {', '.join(WEIGHT_ONLY + FP4_SEARCHED)}; {self.method} "
                            "has its own")
        mine = {f.name for f in dataclasses.fields(METHODS[self.method])}  # the nvfp4 / mxfp4 options hold GPTQ's
        for own in method_options():  # another method's own options, set
            fields, message = [f for f in own.only[0] if f not in mine], own.only[1]
            if any(getattr(self, f) != default_of(self.__dataclass_fields__[f]) for f in fields):
                raise LlmqError(message)
        for flag, value in (("--lm-head", self.lm_head), ("--embedding", self.embedding)):
            if value != "keep" and self.method not in WEIGHT_ONLY:
                raise LlmqError(f"{flag} {value} needs a weight-only method ({', '.join(WEIGHT_ONLY)}): a "
                                f"{self.method} checkpoint has one layout for every quantized layer")
        if self.int8_group_size and not (self.mixed or self.embedding == "int8" or self.lm_head == "int8"):
            raise LlmqError("--int8-group-size sets the groups of the 8-bit weights that --target-bpw / --max-size, "
                            "--embedding int8 and --lm-head int8 make; give one of those (for --bits 8 use "
                            "--group-size)")
        if self.thinking != "auto" and not self.chat_template:
            raise LlmqError(f"--thinking {self.thinking} is a chat template setting; drop it or --no-chat-template")
        if self.max_size is not None:
            parse_size(self.max_size)
            if self.target_bpw is not None:
                raise LlmqError("--max-size and --target-bpw are two spellings of one budget; give one")
        if self.for_engine is not None and not self.mixed:
            raise LlmqError(f"--for {self.for_engine} chooses mixed-precision schemes that engine loads; give "
                            "--target-bpw or --max-size too")
        if self.size_in == "gguf" and self.for_engine not in (None, "gguf"):
            raise LlmqError(f"--size-in gguf prices the GGUF file, which {self.for_engine} does not load; use --for "
                            "gguf or --size-in checkpoint")
        if self.size_in == "gguf" and not self.mixed:
            raise LlmqError("--size-in gguf prices --target-bpw / --max-size in GGUF bytes; give one of those")
        gguf = "--size-in gguf" if self.size_in == "gguf" else "--for gguf" if self.for_engine == "gguf" else None
        if gguf and ((self.group_size or 0) % 32 or self.int8_group_size % 32):
            raise LlmqError(f"{gguf}: GGUF's blocks hold 32 weights, so --group-size and --int8-group-size "
                            f"must be multiples of 32 (got {self.group_size}, {self.int8_group_size})")
        if self.for_engine == "trtllm" and not self.symmetric:
            raise LlmqError("--for trtllm: TensorRT-LLM's INT4 weight-only kernels take no zero points; drop --asym")
        if self.mixed and (self.method not in WEIGHT_ONLY or self.bits in (5, 8) or self.per_tensor):
            flag = "--target-bpw" if self.target_bpw is not None else "--max-size"
            raise LlmqError(f"{flag} mixes 4-, 8- and 16-bit weight-only layers (with --for, 5-bit and FP8 / FP4 "
                            f"too): use it with --bits 4 and a weight-only method ({', '.join(WEIGHT_ONLY)}), not per "
                            "tensor")

    @property
    def mixed(self) -> bool:
        """Whether a budget (--target-bpw or --max-size) asks for mixed precision."""
        return self.target_bpw is not None or self.max_size is not None

    def ggml_grid(self, in_features: int) -> str | None:
        """The GGML grid (qweight.GGML_WEIGHTS' name) of a linear with `in_features` inputs under --grid: --grid's
        where 256, its super-block, divides them, else its GRID_FALLBACK where 32 does; None: the INT4 fallback of
        resolved()."""
        if self.grid == "int":
            return None
        if in_features % 256 == 0:
            return self.grid
        return GRID_FALLBACK.get(self.grid) if in_features % 32 == 0 else None

    def resolved(self, in_features: tuple[int, ...] = ()) -> "QuantizeOptions":
        method = load_method(self.method)
        bits = self.bits or (4 if self.mixed else 8 if 8 in method.bits else method.bits[0])
        g = self.group_size
        if g is None:  # a method with its own block (bnb-nf4's default, nvfp4's and mxfp4's fixed one)
            g = method.group_size
        if g is None:
            fits = [c for c in DEFAULT_GROUPS if all(k % c == 0 for k in in_features)]
            g = fits[0] if bits in (4, 5) and self.method in WEIGHT_ONLY and fits and not self.per_tensor else 0
        unset = {k: v for k, v in METHODS[self.method].unset.items() if getattr(self, k) is None}
        scales = self.scales or ("search" if self.method in WEIGHT_ONLY else None)
        if self.grid != "int":  # the fallback linears: INT4 asymmetric groups of 32, GGUF's Q4_1
            return dataclasses.replace(self, bits=4, group_size=32, symmetric=False, scales=scales, **unset)
        return dataclasses.replace(self, bits=bits, group_size=0 if g in (0, -1) else int(g), scales=scales, **unset)

    @property
    def tags(self) -> str:
        """The running method's own options in the default artifact name (GPTQ's act-order: "-act")."""
        return "".join(tag for k, tag in METHODS[self.method].tags.items() if getattr(self, k))

    @property
    def ignored(self) -> tuple[str, ...]:
        """The modules left dense: `ignore`, less lm_head when it is quantized."""
        return tuple(m for m in self.ignore if not (m == "lm_head" and self.lm_head != "keep"))

    @property
    def search(self) -> bool:
        """Whether integer scales are searched (--scales search), after `resolved()`."""
        return self.scales == "search"

    @property
    def strategy(self) -> str:
        return "tensor" if self.per_tensor else ("group" if self.group_size and self.group_size > 0 else "channel")
