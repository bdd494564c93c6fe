"""``torch.compile`` settings."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from lightning_accel.config._validation import check_bool, check_choice, fill_none_with_defaults
from lightning_accel.config.kwargs import KwargsHandler
from lightning_accel.enums import DynamoBackend

__all__ = ["TorchDynamoPlugin"]

# Accelerate lists the first three; torch.compile also accepts the fourth.
_COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass
class TorchDynamoPlugin(KwargsHandler):
    """Settings for compiling models with ``torch.compile``.

    Accelerate fills unset fields from ``ACCELERATE_DYNAMO_*`` variables; this class never reads the environment.
    Its defaults are the values Accelerate uses when those variables are unset, and ``None`` means the same default.

    Attributes:
        backend: A :class:`~lightning_accel.enums.DynamoBackend` or its name in any case (``"inductor"``);
            ``NO`` disables compilation.
        mode: ``"default"``, ``"reduce-overhead"``, ``"max-autotune"`` or ``"max-autotune-no-cudagraphs"``.
        fullgraph: Whether graph breaks are errors.
        dynamic: Whether shapes are traced as dynamic; ``None`` lets torch decide.
        options: Backend options dict (cannot be combined with a ``mode`` other than ``"default"``).
        disable: Whether ``torch.compile`` is a no-op (for testing).
        use_regional_compilation: Whether repeated blocks are compiled one class at a time, which shortens cold
            compilation.

    :meth:`to_kwargs` gives ``torch.compile`` arguments: the backend as its lower-case name and no
    ``use_regional_compilation``.

    """

    backend: DynamoBackend = DynamoBackend.NO
    mode: str = "default"
    fullgraph: bool = False
    dynamic: bool | None = None
    options: dict[str, Any] | None = None
    disable: bool = False
    use_regional_compilation: bool = False

    def __post_init__(self) -> None:
        fill_none_with_defaults(self, ("backend", "mode", "fullgraph", "use_regional_compilation"))
        if not isinstance(self.backend, DynamoBackend):
            if not isinstance(self.backend, str) or self.backend.upper() not in DynamoBackend:
                raise ValueError(
                    f"backend must be one of {[b.value.lower() for b in DynamoBackend]} (any case), "
                    f"got {self.backend!r}"
                )
            self.backend = DynamoBackend(self.backend.upper())
        check_choice("mode", self.mode, _COMPILE_MODES)
        check_bool("fullgraph", self.fullgraph)
        check_bool("dynamic", self.dynamic, optional=True)
        if self.options is not None and not isinstance(self.options, dict):
            raise TypeError(f"options must be a dict or None, got {self.options!r}")
        if self.options and self.mode != "default":
            raise ValueError(
                f"options and mode={self.mode!r} cannot be combined (torch.compile takes one of them); "
                "drop mode or move its settings into options"
            )
        check_bool("disable", self.disable)
        check_bool("use_regional_compilation", self.use_regional_compilation)

    def to_dict(self) -> dict[str, Any]:
        """Return the fields, with ``backend`` as its lower-case name."""
        values = copy.deepcopy(self.__dict__)
        values["backend"] = self.backend.value.lower()
        return values

    def to_kwargs(self) -> dict[str, Any]:
        """Return the ``torch.compile`` arguments that differ from the defaults."""
        kwargs = super().to_kwargs()
        kwargs.pop("use_regional_compilation", None)
        return kwargs
