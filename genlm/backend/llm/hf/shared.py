"""`SharedModel`: the model object a user hands to `AsyncTransformer`, as the LMs over it
share it (`SharedModel.of`): one lock, under which each step sets what it needs
(`ModelForward.serving`: peft's layers and the attention implementation live on the shared
modules); one peft wrapper holding every LM's adapters under names of its own (a forward
names each row's adapter); and what the model was given as (train mode, attention
implementation, ``requires_grad``), restored once its last LM closes or adapter goes."""

from __future__ import annotations

import itertools
import threading
import warnings
import weakref
from typing import Any

import torch

# Each model object's; a weak map, and a `SharedModel` holds the model only through its
# peft wrapper while an adapter is loaded, so a model no LM serves can be collected.
_SHARED: weakref.WeakKeyDictionary[torch.nn.Module, SharedModel] = weakref.WeakKeyDictionary()


class SharedModel:
    """What the LMs over one model object share (see the module's doc)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.users: weakref.WeakSet[object] = weakref.WeakSet()  # the LMs' forwards over it
        self.peft: Any = None  # the peft model holding the LMs' adapters, while any is loaded
        self._peft_ids = itertools.count()
        self._requires_grad: list[tuple[torch.nn.Parameter, bool]] = []  # before peft
        self.given_training = False
        self.given_attention: str | None = None  # before an LM set its own
        self.given_lora: Any = None  # the ``peft_config`` of LoRA layers the model came with

    @classmethod
    def of(cls, model: torch.nn.Module) -> SharedModel:
        """The `SharedModel` of ``model`` (made by the first LM over it; one, even for LMs
        built at once in two threads: ``dict.setdefault`` is atomic)."""
        return _SHARED.setdefault(model, cls())

    def join(self, model: torch.nn.Module, user: object) -> None:
        """(Under the lock) ``user`` starts serving ``model``, in eval mode; the first notes
        what the model was given as."""
        if not self.users:
            self.given_training = model.training
            self.given_attention = None
            self.given_lora = model.__dict__.get("peft_config")
        self.users.add(user)
        model.eval()

    def leave(self, model: Any, user: object, adapters: list[str]) -> None:
        """``user`` stops serving ``model``: its ``adapters`` (peft names) are removed; the
        last user restores the model's attention implementation and train mode."""
        from genlm.backend.llm.hf.step import CASCADE_ATTENTION, set_attention

        with self.lock:
            for peft_name in adapters:
                self.unload_adapter(peft_name)
            self.users.discard(user)
            if self.users:
                return
            given = self.given_attention
            if given is not None and model.config._attn_implementation == CASCADE_ATTENTION:
                set_attention(model, given)
            if self.given_training:
                model.train()

    def check_lora_layers(self, model: torch.nn.Module) -> None:
        """RuntimeError if ``model`` holds LoRA layers that no LM over it loaded (nor came
        with it): every row would include them."""
        config = model.__dict__.get("peft_config")  # peft marks the models it injects
        if config is None or config is self.given_lora:
            return
        if self.peft is None or config is not self.peft.peft_config:
            raise RuntimeError(
                "the model holds LoRA layers that no AsyncTransformer over it loaded (peft "
                "injected them after the LM was built), which would change every row: "
                "remove them (peft's unload()), or load adapters with add_new_lora"
            )

    def load_adapter(self, model: torch.nn.Module, lora_path: str) -> str:
        """Check the adapter at ``lora_path`` and load it into the shared peft model under a
        fresh name, which is returned; a failure leaves the model as it was (no LoRA layers
        left injected)."""
        from genlm.backend._install import import_extra
        from genlm.backend.llm.adapters import check_peft_shapes, read_peft_adapter

        peft = import_extra("peft", "lora", "LoRA adapters need peft")

        path, weights = read_peft_adapter(lora_path)
        check_peft_shapes(weights, model, path)
        # peft sees its own names: a user's name may hold "." (not a module name), be
        # "__base__", or be part of peft's "lora_" prefix, which peft misreads.
        peft_name = f"genlm{next(self._peft_ids)}"
        with self.lock:
            try:
                if self.peft is None:
                    self._requires_grad = [(p, p.requires_grad) for p in model.parameters()]
                    self.peft = peft.PeftModel.from_pretrained(
                        model, str(path), adapter_name=peft_name
                    ).eval()
                else:
                    self.peft.load_adapter(str(path), adapter_name=peft_name)
                    self.peft.eval()
            except Exception:
                self._unload_partial(model, peft_name)
                raise
        return peft_name

    def unload_adapter(self, peft_name: str) -> None:
        """Remove an adapter; with the last one, peft's layers go and the model is plain
        again (in place), its parameters' ``requires_grad`` as before."""
        with self.lock:
            if set(self.peft.peft_config) != {peft_name}:
                with warnings.catch_warnings():
                    # Which adapter peft calls "active" is moot: each forward names its own.
                    warnings.filterwarnings("ignore", "Adapter .* was active which is now deleted")
                    self.peft.delete_adapter(peft_name)
                return
            self.peft.unload()
            self.peft = None
            self._restore_requires_grad()

    def _unload_partial(self, model: torch.nn.Module, peft_name: str) -> None:
        """Undo a failed load of ``peft_name``: unload what peft added of it, or, if the
        model had no adapter before, put every layer peft wrapped back to its base layer."""
        if self.peft is not None:  # it serves other adapters: remove only this one
            if peft_name in self.peft.peft_config:
                self.unload_adapter(peft_name)
            return
        from peft.tuners.tuners_utils import BaseTunerLayer

        for name, module in list(model.named_modules()):
            if isinstance(module, BaseTunerLayer):
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, module.get_base_layer())
        if hasattr(model, "peft_config"):
            del model.peft_config
        self._restore_requires_grad()

    def _restore_requires_grad(self) -> None:
        for parameter, requires_grad in self._requires_grad:
            parameter.requires_grad_(requires_grad)
        self._requires_grad = []
