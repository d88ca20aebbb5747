"""The reviewed names of the snapshot allow-list (``targets``): what restoring a snapshot may name.

Data only, reviewed by hand: where torch's builtin tensor functions live and
which of them are refused, the Python-level functions exported and FX graphs
really contain (each tensor math or a shape check: none reads files,
imports, compiles or evaluates text), the value types, the side-effect-free
builtins, and the module roots that are never imported whole.
"""

from __future__ import annotations

import torch

__all__ = [
    "TORCH_C_HOMES",
    "C_HOME_OBJECTS",
    "DENIED_TORCH_BUILTINS",
    "REVIEWED_FUNCTIONS",
    "REVIEWED_CLASSES",
    "SAFE_BUILTINS",
    "DENIED_OPERATOR",
    "UNSAFE_ROOTS",
]

#: Where torch's builtin (C) tensor functions live: ``torch.add`` is a method of
#: ``torch._C._VariableFunctionsClass``, ``F.linear`` lives in ``torch._C._nn``,
#: tensor methods are descriptors of ``torch._C.TensorBase``.
TORCH_C_HOMES: frozenset[str] = frozenset(
    {
        "torch._C._VariableFunctionsClass",
        "torch._C._nn",
        "torch._C._fft",
        "torch._C._linalg",
        "torch._C._special",
        "torch._C._nested",
        "torch._C._sparse",
        "torch._C.TensorBase",
    }
)

C_HOME_OBJECTS: tuple[object, ...] = (
    torch._C._VariableFunctions,
    torch._C._nn,
    torch._C._fft,
    torch._C._linalg,
    torch._C._special,
    torch._C._nested,
    torch._C._sparse,
    torch._C.TensorBase,
)

#: Builtin torch functions that touch files, devices or process-wide state rather
#: than compute on their arguments (names as they appear in the homes above).
DENIED_TORCH_BUILTINS: frozenset[str] = frozenset(
    {
        "from_file",
        "_print",
        "_cufft_set_plan_cache_max_size",
        "_cufft_clear_plan_cache",
        "untyped_storage",
        "storage",
        "_typed_storage",
        "record_stream",
        "set_",
        "share_memory_",
        "_share_memory_",
        "pin_memory",
        "_pin_memory",
        "data_ptr",
        "_make_subclass",
    }
)

# Reviewed Python-level functions, by module.  Each is tensor math or a shape
# check: none reads files, imports, compiles or evaluates text.
_NN_FUNCTIONAL = (
    "adaptive_avg_pool2d",
    "adaptive_avg_pool3d",
    "adaptive_max_pool1d",
    "adaptive_max_pool2d",
    "adaptive_max_pool3d",
    "batch_norm",
    "celu",
    "dropout",
    "dropout1d",
    "dropout2d",
    "dropout3d",
    "alpha_dropout",
    "elu",
    "embedding",
    "embedding_bag",
    "glu",
    "group_norm",
    "hardsigmoid",
    "hardswish",
    "hardtanh",
    "instance_norm",
    "interpolate",
    "layer_norm",
    "leaky_relu",
    "local_response_norm",
    "log_softmax",
    "max_pool1d",
    "max_pool2d",
    "max_pool3d",
    "mish",
    "normalize",
    "pad",
    "relu",
    "relu6",
    "rms_norm",
    "selu",
    "sigmoid",
    "silu",
    "softmax",
    "softmin",
    "softsign",
    "tanh",
    "tanhshrink",
    "threshold",
    "unfold",
    "fold",
)
_TORCH_FUNCTIONAL = (
    "atleast_1d",
    "atleast_2d",
    "atleast_3d",
    "block_diag",
    "broadcast_shapes",
    "broadcast_tensors",
    "cartesian_prod",
    "cdist",
    "einsum",
    "meshgrid",
    "norm",
    "split",
    "tensordot",
    "unique",
    "unique_consecutive",
    "unravel_index",
)
_TORCH_SYM = (
    "_assert",
    "_check",
    "_check_is_size",
    "_sym_sqrt",
    "sym_constrain_range",
    "sym_constrain_range_for_size",
    "sym_float",
    "sym_int",
    "sym_ite",
    "sym_max",
    "sym_min",
    "sym_not",
    "sym_sqrt",
    "sym_sum",
)

#: Python-level functions graphs really contain, by the module that defines them.
REVIEWED_FUNCTIONS: frozenset[str] = frozenset(
    [f"torch.nn.functional.{n}" for n in _NN_FUNCTIONAL]
    + [f"torch.functional.{n}" for n in _TORCH_FUNCTIONAL]
    + [f"torch.{n}" for n in _TORCH_SYM]
    + [f"torch._tensor.Tensor.{n}" for n in ("split", "unflatten", "norm", "unique", "stft")]
    + [
        "torch._C._set_grad_enabled",  # pre-dispatch exports wrap no_grad regions in it
        "torch.autograd.grad_mode._enter_inference_mode",
        "torch.autograd.grad_mode._exit_inference_mode",
        "torch.amp.autocast_mode._enter_autocast",
        "torch.amp.autocast_mode._exit_autocast",
        "torch.fx._symbolic_trace._assert_is_none",
        "torch.export._unlift._check_input_constraints_pre_hook",
    ]
)

#: Value and annotation types a snapshot may name (pytree nodes, ``node.type``).
REVIEWED_CLASSES: frozenset[str] = frozenset(
    {
        "torch.Tensor",
        "torch.nn.parameter.Parameter",
        "torch.nn.parameter.Buffer",
        "torch.Size",
        "torch.SymInt",
        "torch.SymFloat",
        "torch.SymBool",
        "torch.dtype",
        "torch.device",
        "torch.layout",
        "torch.memory_format",
    }
)

#: The side-effect-free builtins a graph may name (``builtins.getattr`` etc.).
SAFE_BUILTINS: frozenset[str] = frozenset(
    {
        "abs",
        "all",
        "any",
        "bool",
        "complex",
        "dict",
        "divmod",
        "float",
        "frozenset",
        "getattr",
        "hasattr",
        "int",
        "isinstance",
        "issubclass",
        "len",
        "list",
        "max",
        "min",
        "pow",
        "range",
        "reversed",
        "round",
        "set",
        "slice",
        "sorted",
        "str",
        "sum",
        "tuple",
        "zip",
        "enumerate",
        "map",
        "filter",
        "Ellipsis",
        "NotImplemented",
    }
)
#: ``operator`` functions that would let a graph reach names it does not spell out.
DENIED_OPERATOR: frozenset[str] = frozenset({"attrgetter", "methodcaller", "call"})

UNSAFE_ROOTS = frozenset(
    {
        "builtins",
        "os",
        "posix",
        "nt",
        "subprocess",
        "sys",
        "importlib",
        "pickle",
        "marshal",
        "ctypes",
        "shutil",
        "runpy",
        "code",
        "codeop",
        "pty",
        "socket",
        "torch",
        "operator",
        "_operator",
        "",
    }
)
