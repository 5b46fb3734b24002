"""``attn_implementation="memfit"`` for HuggingFace transformers.

HuggingFace models pick their attention kernel by name from a registry
(``transformers.AttentionInterface``), and build their masks in the format that kernel expects
(``transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS``). Registering memfit's attention
there lets any model that supports ``"sdpa"`` train with ``memfit.nn.attention`` instead: SDPA's
fused kernel where it applies and memfit's chunked one where SDPA would silently store the L x L
probabilities (dropout on CPU, masks that require grad, position biases). The masks are SDPA's.

``import memfit`` makes the name work whatever the import order, without importing transformers
(seconds): it registers at once in whichever of the two registry modules transformers has already
loaded, and for the others puts a finder on ``sys.meta_path`` that registers as soon as transformers
loads them, which it does before any model can check the name (see NOTE [Registering on import]).
``register_huggingface()`` registers at once, importing transformers.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from memfit.nn.attention import attention

__all__ = [
    "register_huggingface",
    "register_when_imported",
    "memfit_attention_forward",
    "IMPLEMENTATION",
]

#: The name to pass as ``attn_implementation``.
IMPLEMENTATION = "memfit"


def memfit_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    position_bias: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HuggingFace's attention-function contract: [B, H, L, D] in, [B, L, H, Dv] out."""
    if kwargs.get("softcap") is not None:
        raise ValueError("memfit attention has no softcap; use attn_implementation='eager' for it")
    if kwargs.get("output_attentions", False):
        raise ValueError(
            "memfit attention never materialises the attention probabilities, so it cannot "
            "return them: use attn_implementation='eager' for output_attentions=True"
        )
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    q_length = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(q_length > 1 and attention_mask is None and causal)
    if position_bias is not None:
        # transformers is optional: imported where a transformers model is running
        from transformers.integrations.sdpa_attention import create_position_bias_mask

        attention_mask = create_position_bias_mask(
            position_bias, attention_mask, causal, query, key
        )
        causal = False
    out = attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        is_causal=causal,
        scale=scaling,
    )
    return out.transpose(1, 2).contiguous(), None


def _register_attention(modeling_utils: ModuleType) -> bool:
    interface = getattr(modeling_utils, "AttentionInterface", None)
    if interface is None:  # transformers older than its attention registry
        return False
    interface.register(IMPLEMENTATION, memfit_attention_forward)
    return True


def _register_masks(masking_utils: ModuleType) -> bool:
    masks = getattr(masking_utils, "ALL_MASK_ATTENTION_FUNCTIONS", None)
    if masks is None:
        return False
    masks.register(IMPLEMENTATION, masking_utils.sdpa_mask)
    return True


#: transformers' modules that hold a registry memfit's name goes in, and how to put it there.
#: Each is filled when its module has run: models import both before they can use the name.
_REGISTRIES: dict[str, Callable[[ModuleType], bool]] = {
    "transformers.modeling_utils": _register_attention,  # AttentionInterface, checked at init
    "transformers.masking_utils": _register_masks,  # ALL_MASK_ATTENTION_FUNCTIONS, at forward
}


def register_huggingface() -> bool:
    """Register ``attn_implementation="memfit"`` with transformers now, importing it; False if it
    is not installed or has no attention registry."""
    try:  # transformers is optional, and importing memfit must not import it
        from transformers import masking_utils, modeling_utils
    except ImportError:
        return False
    attention = _register_attention(modeling_utils)
    masks = _register_masks(masking_utils)
    return attention and masks


# NOTE [Registering on import]
# transformers checks ``attn_implementation`` against ``AttentionInterface`` in
# ``PreTrainedModel.__init__`` (``_check_and_adjust_attn_implementation``, which ``from_config``,
# ``from_pretrained``, a config's ``_attn_implementation`` and ``set_attn_implementation`` all go
# through), and looks the mask format up in ``ALL_MASK_ATTENTION_FUNCTIONS`` at forward; both live
# in modules that every model file imports, so filling each registry right after its module has run
# is before any use (checked on transformers 5.24). ``_RegisterOnImport`` sits first on
# ``sys.meta_path``; asked for one of those modules (transformers' lazy top-level module imports
# them through ``importlib.import_module``, so through it too) it lets the other finders find the
# spec and wraps only its loader's ``exec_module``: the module runs as it would, with its own
# ``__loader__``, then its registry is filled. A failure there is a warning naming the fix, never a
# failed import of transformers. The finder leaves ``sys.meta_path`` once both are filled; until
# then it costs a dictionary look-up per import.


class _RegisterOnImport:
    """A ``sys.meta_path`` finder that, once a module named in ``registries`` has run, calls its
    registration with it."""

    def __init__(self, registries: dict[str, Callable[[ModuleType], bool]]) -> None:
        self.pending = dict(registries)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self.pending:
            return None
        for finder in list(sys.meta_path):
            find_spec = getattr(finder, "find_spec", None)
            if finder is self or find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _ThenRegister(spec.loader, self, fullname)
        return spec

    def loaded(self, name: str, module: ModuleType) -> None:
        register = self.pending.pop(name, None)
        if not self.pending:
            try:
                sys.meta_path.remove(self)
            except ValueError:  # removed already, by another thread or by someone else
                pass
        if register is not None:
            _register_warning_on_failure(register, name, module)


class _ThenRegister:
    """A module loader that runs ``loader``'s module, then tells ``hook`` it has."""

    def __init__(self, loader: Any, hook: _RegisterOnImport, name: str) -> None:
        self.loader, self.hook, self.name = loader, hook, name

    def __getattr__(self, attribute: str) -> Any:
        if attribute in ("loader", "hook", "name"):  # not set yet: no recursion
            raise AttributeError(attribute)
        return getattr(self.loader, attribute)

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.loader  # the module never sees this wrapper
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        self.hook.loaded(self.name, sys.modules.get(self.name, module))


def _register_warning_on_failure(
    register: Callable[[ModuleType], bool], name: str, module: ModuleType
) -> None:
    try:
        register(module)
    except Exception as error:  # transformers' import must go on, whatever happens here
        warnings.warn(
            f"memfit could not register attn_implementation={IMPLEMENTATION!r} in {name} "
            f"({type(error).__name__}: {error}); call memfit.nn.register_huggingface() after "
            "importing transformers to register it, or to see the full error",
            RuntimeWarning,
            stacklevel=2,
        )


def register_when_imported() -> None:
    """Make ``attn_implementation="memfit"`` work whatever the import order, importing nothing:
    register now in the registries transformers has loaded, and the others once it loads them
    (NOTE [Registering on import]). Nothing if transformers is not installed. ``import memfit``
    calls it."""
    if "transformers" not in sys.modules and importlib.util.find_spec("transformers") is None:
        return
    if any(isinstance(finder, _RegisterOnImport) for finder in sys.meta_path):
        return
    pending = {}
    for name, register in _REGISTRIES.items():
        module = sys.modules.get(name)
        if module is None:
            pending[name] = register
        else:
            _register_warning_on_failure(register, name, module)
    if pending:
        sys.meta_path.insert(0, _RegisterOnImport(pending))
