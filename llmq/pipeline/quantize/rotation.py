"""`--rotate hadamard`: an orthogonal rotation Q of the residual stream folded offline into the weights (QuaRot's /
SpinQuant's R1), so that a quantizer sees weights whose outlier input channels are spread over all of them.

Every vector the residual stream carries becomes x Q. RMSNorm commutes with an orthogonal Q once its gain is moved
out (|x Q| = |x|), so each norm's gain g is folded into the linears it feeds and the norm becomes the identity; then
    the embedding table E       -> E Q                  (its rows are residual vectors)
    a linear reading the stream -> W diag(g) Q          (q / k / v, gate / up, routers, Gated DeltaNet's inputs)
    a linear writing to it      -> Q^T W, bias b Q      (o_proj, down_proj, out_proj: Arch.writers)
    the output head             -> W diag(g_final) Q    (its own tensor: a tied table cannot be both E Q and this)
and the model computes the same function in exact arithmetic, in any engine, with no runtime support (the rotated
checkpoint is an ordinary one of the same family, its lm_head untied). Norms that scale a branch's output before it
joins the stream (Gemma's sandwich norms) do not commute with Q: such families are refused (Arch.rotation_refused).

Q = diag(s) H / sqrt(n): random signs s (seeded) times a Hadamard matrix H of the hidden size n, built as a Kronecker
product of a Paley matrix of order m and Sylvester's of order n / m (a power of two); for a size no such H has, a
random orthogonal matrix (QR of a Gaussian one). The Kronecker form applies Q in O(n (m + log n)) a row."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from ...errors import LlmqError
from ...models import ModelSpec, qformat


def _prime(q: int) -> bool:
    return q > 1 and all(q % d for d in range(2, int(q ** 0.5) + 1))


def _paley(m: int) -> torch.Tensor | None:
    """A Hadamard matrix of order m by Paley's constructions (I: m = q + 1, q prime = 3 mod 4; II: m = 2 (q + 1), q
    prime = 1 mod 4), or of order 1 (a power of two is all Sylvester's); None where neither gives order m."""
    if m == 1:
        return torch.ones(1, 1, dtype=torch.float64)
    q = m - 1 if _prime(m - 1) and (m - 1) % 4 == 3 else m // 2 - 1
    if not (_prime(q) and (m == q + 1 or (m == 2 * (q + 1) and q % 4 == 1))):
        return None
    residues = {(i * i) % q for i in range(1, q)}
    chi = torch.tensor([0.0] + [1.0 if d in residues else -1.0 for d in range(1, q)], dtype=torch.float64)
    idx = torch.arange(q)
    jacobsthal = chi[(idx[None, :] - idx[:, None]) % q]   # chi(j - i)
    ones = torch.ones(q, dtype=torch.float64)
    if m == q + 1:   # I + [[0, 1], [-1, Q]] with Q antisymmetric
        s = torch.zeros(m, m, dtype=torch.float64)
        s[0, 1:], s[1:, 0], s[1:, 1:] = ones, -ones, jacobsthal
        return s + torch.eye(m, dtype=torch.float64)
    c = torch.zeros(q + 1, q + 1, dtype=torch.float64)   # the symmetric conference matrix [[0, 1], [1, Q]]
    c[0, 1:], c[1:, 0], c[1:, 1:] = ones, ones, jacobsthal
    a = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    b = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    return torch.kron(c, a) + torch.kron(torch.eye(q + 1, dtype=torch.float64), b)


class Rotation:
    """Q = diag(signs) (A kron H_b) / sqrt(n), A of Paley's construction, H_b Sylvester's of order b = n / m (a
    power of two, applied as butterflies), or a dense orthogonal Q; `factors` = (A,) or (Q,), in float64."""

    def __init__(self, n: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.n = n
        self.signs = torch.randint(0, 2, (n,), generator=gen).double() * 2 - 1
        twos = (n & -n).bit_length() - 1   # n = odd x 2^twos
        core = next((c for k in range(twos + 1) if (c := _paley(n >> k)) is not None), None)
        if core is not None:
            self.kind, self.factors = "hadamard", (core,)
            if not torch.equal(core @ core.T, core.shape[0] * torch.eye(core.shape[0], dtype=torch.float64)):
                raise AssertionError(f"the Paley construction of order {core.shape[0]} is not a Hadamard matrix")
        else:
            q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
            self.kind, self.factors = "orthogonal", (q * torch.sign(torch.diagonal(r))[None, :],)

    def right(self, x: torch.Tensor) -> torch.Tensor:
        """x Q over x's last dimension, in float64."""
        x = x.double() * self.signs
        if self.kind == "orthogonal":
            return x @ self.factors[0]
        a = self.factors[0]
        m, b = a.shape[0], self.n // a.shape[0]
        y = torch.einsum("...ij,ik->...kj", x.reshape(*x.shape[:-1], m, b), a)
        lead, h = (*x.shape[:-1], m), 1
        while h < b:   # Sylvester's H of order b, the fast Walsh-Hadamard way: log2(b) butterflies
            y = y.reshape(*lead, b // (2 * h), 2, h)
            y = torch.stack((y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]), -2)
            h *= 2
        return y.reshape(x.shape) / self.n ** 0.5


def check_rotatable(spec: ModelSpec) -> None:
    """One line where a rotation of the residual stream cannot be folded into this family (Arch.rotation_refused)."""
    if spec.arch.rotation_refused:
        raise LlmqError(f"--rotate: cannot rotate {spec.arch.architecture}: {spec.arch.rotation_refused}")


class RotatedTensors(Mapping):
    """A checkpoint's tensors (a source_tensors mapping) as the rotated model's: a decoder layer's in float32 (the
    quantizer rounds them; the layer stores its dense ones in the stored dtype), the embedding, final norm and head
    in their stored dtype; with `lm_head.weight` where the source ties it to the embedding."""

    def __init__(self, tensors: Mapping, spec: ModelSpec, seed: int):
        check_rotatable(spec)
        self.tensors, self.spec, self.seed, arch = tensors, spec, seed, spec.arch
        self.head = f"{qformat.LM_HEAD}.weight"
        self.embedding = f"{qformat.EMBEDDING}.weight"
        self.rotation = Rotation(spec.hidden_size, seed)
        self.final_norm = f"{arch.final_norm}.weight"
        self.gain_of: dict[str, str] = {}   # a reading linear's weight -> its norm's weight
        self.writers: set[str] = set()      # writing linears' weights and biases
        for i in range(spec.num_layers):
            linear, prefix = i in spec.linear_layers, arch.prefix(i)
            for producer, is_norm, consumers in arch.feed_paths(spec.num_experts, linear):
                for c in consumers if is_norm else ():
                    self.gain_of[f"{prefix}.{c}.weight"] = f"{prefix}.{producer}.weight"
            for path in arch.writer_paths(spec.num_experts, linear):
                self.writers |= {f"{prefix}.{path}.weight", f"{prefix}.{path}.bias"}
        self.norms = set(self.gain_of.values()) | {self.final_norm}
        self._gains: dict[str, torch.Tensor] = {}   # read once: a MoE layer's norm feeds every expert

    def _gain(self, norm: str) -> torch.Tensor:
        if norm not in self._gains:
            self._gains[norm] = self.tensors[norm].double() + self.spec.arch.norm_offset
        return self._gains[norm]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name == self.head and self.head not in self.tensors:
            stored = self.tensors[self.embedding]
        else:
            stored = self.tensors[name]
        q = self.rotation
        if name in self.norms:
            out = torch.full_like(stored, 1.0 - self.spec.arch.norm_offset, dtype=torch.float64)
        elif name == self.embedding:
            out = q.right(stored)
        elif name == self.head:
            out = q.right(stored.double() * self._gain(self.final_norm))
        elif name in self.gain_of:
            out = q.right(stored.double() * self._gain(self.gain_of[name]))
        elif name in self.writers:
            out = q.right(stored.double().T).T if stored.dim() == 2 else q.right(stored)
        else:
            return stored
        top = name in (self.embedding, self.head, self.final_norm)
        return out.to(stored.dtype if top else torch.float32).contiguous()

    def __contains__(self, name: object) -> bool:
        return name == self.head or name in self.tensors

    def __iter__(self) -> Iterator[str]:
        yield from self.tensors
        if self.head not in self.tensors:
            yield self.head

    def __len__(self) -> int:
        return len(self.tensors) + (self.head not in self.tensors)

    def manifest(self) -> dict:
        """The artifact's record: the rotation (a Hadamard one's Paley and Sylvester orders), its seed, the head."""
        q = self.rotation
        m = q.factors[0].shape[0]
        orders = {"paley": m, "sylvester": q.n // m} if q.kind == "hadamard" else {}
        return {"kind": q.kind, "size": q.n, **orders, "seed": self.seed,
                "untied_lm_head": self.head not in self.tensors}
