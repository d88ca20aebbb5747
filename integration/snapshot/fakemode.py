"""A ``FakeTensorMode`` for restored static graphs that is built on its first use.

A restored ``node.meta["val"]`` must be a real ``FakeTensor`` (torch's own
checks, ``detect_fake_mode`` and later passes test ``isinstance(v,
FakeTensor)``), and a FakeTensor needs its mode.  But ``FakeTensorMode()``
imports ``torch._dynamo.config``, which runs dynamo's package ``__init__``:
about 0.8 s of a restart, for a mode that the first forward of a restored
model never uses (running a GraphModule does not touch ``meta["val"]``).

:class:`DeferredFakeTensorMode` is that mode with its ``__init__`` put off.
Constructing it reads only the two settings ``FakeTensor.__new__`` reads from
its mode (both from the cheap functorch config).  The first time anything
else is asked of it (an attribute it does not have yet, entering it, a
dispatch) it runs ``FakeTensorMode.__init__`` with the arguments it was given
and keeps any attribute set on it in the meantime (those are newer than the
defaults ``__init__`` writes).  From then on it is an ordinary FakeTensorMode.
Graphs with symbolic shapes do not use it: they need a ``ShapeEnv`` at once.
"""

from __future__ import annotations

import threading
from typing import Any

from torch._subclasses.fake_tensor import FakeTensorMode

__all__ = ["DeferredFakeTensorMode"]

_INIT_LOCK = threading.Lock()  # two threads' first uses must not both run __init__
_LOCAL = threading.local()  # set while this thread runs a postponed __init__ (its reads must not recurse)


class DeferredFakeTensorMode(FakeTensorMode):
    """``FakeTensorMode(**kwargs)``, initialised on first use (see the module docstring)."""

    def __init__(self, **kwargs: Any) -> None:  # noqa: D107 - deliberately not calling super().__init__ yet
        import torch._functorch.config as functorch_config

        state = self.__dict__
        state["_deferred_init"] = kwargs
        state["_allow_unsafe_data_ptr_access"] = functorch_config.fake_tensor_allow_unsafe_data_ptr_access
        state["allow_meta"] = functorch_config.fake_tensor_allow_meta

    @property
    def initialised(self) -> bool:
        """Has ``FakeTensorMode.__init__`` run (is dynamo imported on its account)?"""
        return "_deferred_init" not in self.__dict__

    def materialize(self) -> None:
        """Run the postponed ``FakeTensorMode.__init__`` once; keep attributes set since construction."""
        state = self.__dict__
        if "_deferred_init" not in state:
            return
        with _INIT_LOCK:
            kwargs = state.get("_deferred_init")
            if kwargs is None:
                return
            newer = {k: v for k, v in state.items() if k != "_deferred_init"}
            _LOCAL.initialising = True
            try:
                FakeTensorMode.__init__(self, **kwargs)
            finally:
                _LOCAL.initialising = False
            state.update(newer)
            del state["_deferred_init"]  # last: other threads see an initialised mode only when it is one

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes the instance does not have: before __init__ ran, that is most of them.
        if "_deferred_init" in self.__dict__ and not getattr(_LOCAL, "initialising", False):
            self.materialize()
            return getattr(self, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __enter__(self) -> Any:
        self.materialize()
        return super().__enter__()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.materialize()
        return super().__torch_dispatch__(func, types, args, kwargs)
