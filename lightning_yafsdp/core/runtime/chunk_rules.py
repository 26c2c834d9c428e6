"""Which root units may run in row chunks, and what each use of a chunked weight computes.

[Note: chunkable modules]
A chunked module's forward is replaced by a loop over its chunks ([Note: row
chunks]), so only modules whose forward is known exactly may be chunked:

- ``nn.Embedding`` (no ``max_norm``, ``sparse`` or ``scale_grad_by_freq``: those
  write or need the whole table) and ``nn.Linear``, of exactly these types;
- a *scaled embedding*: a direct subclass of ``nn.Embedding`` whose ``forward`` is
  the parent's times ``self.embed_scale`` (Hugging Face's Gemma, Gemma 2/3, BART,
  M2M100, ... ``*ScaledWordEmbedding``). It is recognised by the source of its
  ``forward``: a single ``return super().forward(input_ids) * self.embed_scale``
  (optionally ``.to(self.weight.dtype)``), nothing else; any other body, or a class
  whose source cannot be read, keeps its whole unit.

A unit of several such modules sharing one weight (a tied embedding and head) runs
each use as chunks of its own ([Note: tied row chunks]). A module whose parameters are
all frozen (a LoRA base's embedding and head) runs in chunks of its frozen rows, which
get no grads; a LoRA-wrapped module (it has submodules) or one mixing frozen and
trainable parameters keeps a whole unit.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Callable

import torch
from torch import nn

# The bodies of a scaled embedding's forward that chunking reproduces exactly.
_SCALED_FORWARDS = {
    "super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)": "cast",
    "super().forward(input_ids) * self.embed_scale": "plain",
}


def is_embedding_use(module: nn.Module) -> bool:
    """Whether a chunkable module is an embedding (its backward reads no weights)."""
    return isinstance(module, nn.Embedding)


def chunk_refusal(modules: list[nn.Module], params: list[nn.Parameter], frozen: list) -> str | None:
    """Why a root unit may not run in row chunks, in a few words (None: it may)."""
    if frozen and params:
        return "it mixes frozen and trainable parameters"
    params = params or frozen  # every parameter frozen: a LoRA base's embedding or head
    for module in modules:
        reason = _module_refusal(module)
        if reason is not None:
            return reason
    if len(modules) == 1:
        own = list(modules[0].parameters(recurse=False))
        if [id(p) for p in params] != [id(p) for p in own]:
            return "its parameters are not its module's own (weight and bias)"
        return None
    # A tied weight: one parameter, the weight of every module (no head bias).
    if len(params) != 1 or any(
        [id(p) for p in m.parameters(recurse=False)] != [id(params[0])] for m in modules
    ):
        return "its modules share more than one weight (a tied head with a bias)"
    return None


def _module_refusal(module: nn.Module) -> str | None:
    kind = type(module).__name__
    if any(True for _ in module.children()):
        return f"{kind} has submodules (a container of the table, or a wrapper such as LoRA)"
    if type(module) is nn.Linear:
        return None
    if not isinstance(module, nn.Embedding):
        return f"{kind} is neither nn.Embedding nor nn.Linear"
    if module.max_norm is not None or module.sparse or module.scale_grad_by_freq:
        return f"{kind} has max_norm, sparse or scale_grad_by_freq (they need the whole table)"
    if type(module) is not nn.Embedding and _scaled_forward(type(module)) is None:
        return f"{kind} subclasses nn.Embedding with a forward of its own"
    return None


def embedding_post_op(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What a chunked embedding applies after the row lookup: the scale of a scaled
    embedding (as its forward computes it), or None for ``nn.Embedding``."""
    if type(module) is nn.Embedding or not isinstance(module, nn.Embedding):
        return None
    if _scaled_forward(type(module)) == "cast":
        return lambda rows: rows * module.embed_scale.to(rows.dtype)
    return lambda rows: rows * module.embed_scale


@functools.cache
def _scaled_forward(cls: type) -> str | None:
    """``"cast"`` / ``"plain"`` if ``cls.forward`` is a known scaled lookup, else None."""
    if cls.__bases__ != (nn.Embedding,) or "forward" not in vars(cls):
        return None
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    function = tree.body[0]
    if not isinstance(function, ast.FunctionDef) or function.decorator_list:
        return None
    body = [
        node
        for node in function.body
        if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
    ]
    args = function.args
    names = [arg.arg for arg in args.args]
    extra = args.vararg or args.kwarg or args.kwonlyargs or args.posonlyargs
    if names != ["self", "input_ids"] or extra or len(body) != 1:
        return None
    if not isinstance(body[0], ast.Return):
        return None
    return _SCALED_FORWARDS.get(ast.unparse(body[0].value))
