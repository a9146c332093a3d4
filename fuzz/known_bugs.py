"""dynajax bugs the fuzzer has found and that are not fixed yet, by signature.

A failure whose signature (``fuzz.check.signature``: ``kind:op:detail``) is listed here
is reported as known: it is not shrunk, gets no reproducer and does not fail
``tests/test_fuzz.py``. Each cause has a strict-xfail regression test in
``tests/test_fuzz_regressions.py``; remove the entries with the fix (the list only
shrinks). One bug shows under several signatures (each op and dtype it reaches).
"""

from __future__ import annotations

_SOFTMAX_0D = "_softmax/_log_softmax return 1/0 for any 0-dim input (NaN in eager for NaN, inf)"
_SIGN_NAN = "aten.sign/sgn are jnp.sign: NaN for NaN (eager 0); also abs's gradient at NaN"
_AMAX_GRAD_NAN = "amax/amin backward over a slice holding NaN: 0 in dynajax, NaN (0/0) in eager"

KNOWN_BUGS: dict[str, str] = {
    "value:torch.exp2:bfloat16": "aten.exp2 is jnp.exp2 in bfloat16 (exp(x*ln2) rounded): "
    "exp2(10) is 1000, eager 1024",
    "value:torch.softmax:bfloat16": _SOFTMAX_0D,
    "value:torch.softmax:float16": _SOFTMAX_0D,
    "value:torch.log_softmax:float16": _SOFTMAX_0D,
    "value:torch.sign:float32": _SIGN_NAN,
    "value:torch.sign:bfloat16": _SIGN_NAN,
    "value:torch.sign:bool": _SIGN_NAN + " (compared after)",
    "grad:torch.abs:float32": _SIGN_NAN,
    "grad:torch.amax:float32": _AMAX_GRAD_NAN,
    "grad:torch.amin:float32": _AMAX_GRAD_NAN,
    "value:torch.addcmul:bfloat16": "x * bool-as-float is 0 where x is inf/NaN (eager NaN): "
    "XLA's simplifier rewrites the product with a converted predicate into a select",
    "value:torch.pow(scalar):float32": "pow(x, 0.5) is jnp.power: pow(-inf, 0.5) = inf and "
    "pow(-0., 0.5) = 0, where eager computes sqrt (NaN, -0.)",
    "value:torch.pow:int64": "integer pow with an int64 exponent of 2**32 or more uses the "
    "exponent's low 32 bits (jnp.power): 3 ** (2**40 + 1) gives 3",
    "crash:?:RuntimeError:RuntimeError: one of the variables needed for gradient compu": (
        "the min-cut partitioner, on the core-ATen-decomposed graph, recomputes a value in "
        "the backward from an input the forward mutates in place; aot_autograd saves that "
        "input, whose version counter the mutation bumps, so backward raises"
    ),
    "raises:torch.index_add:IndexError->RuntimeError": "the value check of index_add raises "
    "RuntimeError; eager raises IndexError('index out of range in self') for 0-/1-dim self",
}
