"""Graph -> Graph, before Inductor: `add(x, a @ b, alpha=s)` becomes `add(x, (a @ b) * s)`.

Inductor (torch 2.13, CPU) fuses an add whose second operand is a matmul into `addmm` and drops `alpha` on the
way: `torch.add(p, a @ b, alpha=-0.1)` ran as `p + a @ b` (`torch.compile` does the same). `p.add_(g, alpha=-lr)`
is PyTorch's update idiom (torch.optim's SGD), so a step written with it was silently wrong. With the scale
applied to the product first, no `alpha` is left to lose.
"""

from __future__ import annotations

import torch
from torch import fx

aten = torch.ops.aten

_ADDS = {aten.add.Tensor, aten.add_.Tensor, aten.sub.Tensor, aten.sub_.Tensor}
_PRODUCTS = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default, aten.matmul.default}


def scale_products_before_adding(gm: fx.GraphModule) -> fx.GraphModule:
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _ADDS or len(node.args) < 2:
            continue
        alpha = node.kwargs.get("alpha", 1)
        product = node.args[1]
        if alpha == 1 or not (isinstance(product, fx.Node) and product.target in _PRODUCTS):
            continue
        with gm.graph.inserting_before(node):
            scaled = gm.graph.call_function(aten.mul.Tensor, (product, alpha))
        scaled.meta.update(product.meta)
        node.args = (node.args[0], scaled, *node.args[2:])
        node.kwargs = {k: v for k, v in node.kwargs.items() if k != "alpha"}
        changed = True
    if changed:
        gm.recompile()
    return gm
