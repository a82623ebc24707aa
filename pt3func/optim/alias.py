"""Ready-made optimizers, each a `chain` of the transformations in `transform.py`."""

from __future__ import annotations

import torch

from pt3func.optim.base import GradientTransformation, ScalarOrSchedule, chain
from pt3func.optim.transform import (
    MaskOrFn,
    add_decayed_weights,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_lion,
    trace,
)


def sgd(
    learning_rate: ScalarOrSchedule,
    momentum: float | None = None,
    nesterov: bool = False,
    weight_decay: float = 0.0,
) -> GradientTransformation:
    """Stochastic gradient descent, with optional momentum and L2 weight decay.

    Matches `torch.optim.SGD(lr, momentum, nesterov=..., weight_decay=..., dampening=0)`:
    `g += weight_decay * p`, `b = momentum * b + g`, `p -= lr * (g + momentum * b if nesterov else b)`
    (Robbins & Monro 1951; momentum: Polyak 1964; Nesterov: Sutskever et al. 2013).

    Args:
        learning_rate: a float or a schedule `count -> lr`.
        momentum: the momentum coefficient; `None` or `0` for plain SGD (no state).
        nesterov: use Nesterov momentum (needs `momentum`).
        weight_decay: L2 penalty coefficient, added to the gradient.

    Returns:
        A `GradientTransformation`.
    """
    if nesterov and not momentum:
        raise ValueError("sgd: nesterov=True needs a positive momentum")
    parts = []
    if weight_decay:
        parts.append(add_decayed_weights(weight_decay))
    if momentum:
        parts.append(trace(decay=momentum, nesterov=nesterov))
    parts.append(scale_by_learning_rate(learning_rate))
    return chain(*parts)


def adam(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """Adam (Kingma & Ba 2015, https://arxiv.org/abs/1412.6980); matches `torch.optim.Adam`.

    Args:
        learning_rate: a float or a schedule `count -> lr`.
        b1: decay rate of the first moment.
        b2: decay rate of the second moment.
        eps: added to the denominator, outside the square root (as in torch).
        eps_root: added inside the square root.
        mu_dtype: dtype of the first moment; the parameter's dtype if `None`.

    Returns:
        A `GradientTransformation`.
    """
    return chain(
        scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype),
        scale_by_learning_rate(learning_rate),
    )


def adamw(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    mask: MaskOrFn = None,
    eps_root: float = 0.0,
    mu_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """Adam with decoupled weight decay (Loshchilov & Hutter 2019, https://arxiv.org/abs/1711.05101).

    The update is `-lr * (adam_direction + weight_decay * p)`, i.e. `torch.optim.AdamW`'s
    `p *= 1 - lr * weight_decay` followed by the Adam step.

    Args:
        learning_rate: a float or a schedule `count -> lr`; it scales the decay too.
        b1: decay rate of the first moment.
        b2: decay rate of the second moment.
        eps: added to the denominator, outside the square root.
        weight_decay: the decoupled weight decay coefficient.
        mask: a pytree of bools with the params' structure (or `params -> mask`) choosing the
            parameters to decay; all of them if `None`.
        eps_root: added inside the square root.
        mu_dtype: dtype of the first moment; the parameter's dtype if `None`.

    Returns:
        A `GradientTransformation`.
    """
    return chain(
        scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )


def lion(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.99,
    weight_decay: float = 1e-3,
    mask: MaskOrFn = None,
    mu_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """Lion (Chen et al. 2023, https://arxiv.org/abs/2302.06675): sign of an interpolated momentum.

    The update is `-lr * (sign(b1 m + (1 - b1) g) + weight_decay * p)`, then `m = b2 m + (1 - b2) g`.
    Lion's updates have unit magnitude per element, so its learning rate is usually 3-10x smaller
    than AdamW's and its weight decay 3-10x larger.

    Args:
        learning_rate: a float or a schedule `count -> lr`.
        b1: interpolation factor of the update direction.
        b2: decay rate of the momentum.
        weight_decay: the decoupled weight decay coefficient.
        mask: a pytree of bools (or `params -> mask`) choosing the parameters to decay.
        mu_dtype: dtype of the momentum; the parameter's dtype if `None`.

    Returns:
        A `GradientTransformation`.
    """
    return chain(
        scale_by_lion(b1=b1, b2=b2, mu_dtype=mu_dtype),
        add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate),
    )
