"""The papers' small problems, offline: the MLP regression and a digits classifier.

Everything here is generated or bundled, so the demo, the examples and the
benchmarks run without downloads:

* :func:`mlp_regression`: the three-layer LeakyReLU regression of Zhao 2026
  Sec. 4.6.1 and 5.4.1 (W3 8x7, W2 7x6, W1 6x5, X 5x4, Y 8x4, all U[0, 1), loss
  1/2 ||Y - W3 s(W2 s(W1 X))||^2), drawn in the papers' order from a seeded
  ``torch.Generator`` (the same numbers as their ``torch.manual_seed`` + ``torch.rand``
  without touching the global RNG);
* :func:`load_digits`: scikit-learn's bundled 8x8 digits (1797 images, 10 classes),
  the stand-in for MNIST in our reproductions of Zhao 2026, Sec. 5.2-5.4;
* :func:`digits_mlp`: the papers' classifier W3 s(W2 s(W1 x)) (Sec. 5.2.3, 5.4.2),
  64-16-10-10 on digits, LeakyReLU(0.1), no biases;
* :func:`hidden_rescaling_sites`: the exact positive-rescaling sites (Zhao 2026
  Ex. 1.2.4) of a LeakyReLU/ReLU MLP, one per hidden layer, for
  Teleport without running detection.

Tensor conventions follow ``nn.Linear``: samples are rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from teleopt.registry import get_action
from teleopt.site import Site

__all__ = [
    "MLPRegression",
    "mlp_regression",
    "regression_loss",
    "Digits",
    "load_digits",
    "digits_mlp",
    "hidden_rescaling_sites",
    "NEGATIVE_SLOPE",
]

NEGATIVE_SLOPE = 0.1
"""LeakyReLU slope of every network in Zhao 2026, Ch. 4-5."""


def regression_loss(output: Tensor, target: Tensor) -> Tensor:
    """1/2 ||Y - f(X)||^2, summed over samples and outputs (Zhao 2026, Sec. 4.6.1, as in the papers' code)."""
    return 0.5 * (target - output).square().sum()


@dataclass
class MLPRegression:
    """The papers' MLP regression: a model, its full batch and its loss.

    Attributes
    ----------
    model:
        ``nn.Sequential(Linear(5, 6), LeakyReLU(0.1), Linear(6, 7), LeakyReLU(0.1), Linear(7, 8))``,
        bias-free, weights U[0, 1).
    inputs, targets:
        X^T (4, 5) and Y^T (4, 8): the papers' 4 samples as rows.
    """

    model: nn.Sequential
    inputs: Tensor
    targets: Tensor

    @staticmethod
    def loss_fn(output: Tensor, target: Tensor) -> Tensor:
        """:func:`regression_loss`."""
        return regression_loss(output, target)

    def loss(self) -> Tensor:
        """The full-batch loss at the model's current weights."""
        return regression_loss(self.model(self.inputs), self.targets)

    def sites(self) -> list[Site]:
        """The exact positive rescalings of both hidden layers (:func:`hidden_rescaling_sites`)."""
        return hidden_rescaling_sites(self.model)


def mlp_regression(seed: int = 0, dtype: torch.dtype = torch.float32) -> MLPRegression:
    """The MLP regression of Zhao 2026, Sec. 4.6.1 / 5.4.1 for one seed.

    W1, W2, W3, X, Y are drawn from U[0, 1) in that order, exactly as the papers'
    code does after ``torch.manual_seed(seed)`` (their seeds are ``n * n * 12345``);
    here from a private ``torch.Generator`` with the same seed, which gives the same
    numbers and leaves the global RNG alone.
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    generator = torch.Generator().manual_seed(seed)
    weights = [torch.rand(6, 5, generator=generator), torch.rand(7, 6, generator=generator), torch.rand(8, 7, generator=generator)]
    x = torch.rand(5, 4, generator=generator)
    y = torch.rand(8, 4, generator=generator)
    linears = [_uninitialised_linear(5, 6, False), _uninitialised_linear(6, 7, False), _uninitialised_linear(7, 8, False)]
    model = nn.Sequential(
        linears[0],
        nn.LeakyReLU(NEGATIVE_SLOPE),
        linears[1],
        nn.LeakyReLU(NEGATIVE_SLOPE),
        linears[2],
    ).to(dtype)  # Module.to converts in place, so `linears` are the model's layers
    with torch.no_grad():
        for layer, w in zip(linears, weights):
            layer.weight.copy_(w)
    return MLPRegression(model, x.T.contiguous().to(dtype), y.T.contiguous().to(dtype))


@dataclass
class Digits:
    """A train/test split of scikit-learn's digits: standardised features (float32) and int64 labels."""

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor

    @property
    def features(self) -> int:
        """Number of input features (64)."""
        return self.x_train.shape[1]

    @property
    def classes(self) -> int:
        """Number of classes (10)."""
        return 10


def load_digits(seed: int = 0, n_test: int = 450, alpha: float = 1.0) -> Digits:
    """scikit-learn's bundled 8x8 digits, shuffled by ``seed``, split into train and the last ``n_test`` samples.

    Features are standardised with the mean and standard deviation of the whole set
    (pixels that are constant get standard deviation 1e-6 added, so they stay 0)
    and multiplied by ``alpha``.  The defaults give 1347 training and 450 test
    images.  Needs scikit-learn (the ``demo`` extra); no download, the data ship
    with scikit-learn.
    """
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError('load_digits needs scikit-learn: pip install "teleopt[demo]"') from exc
    if not isinstance(n_test, int) or isinstance(n_test, bool) or not 0 < n_test < 1797:
        raise ValueError(f"n_test must be an int in [1, 1796], got {n_test!r}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    x, y = sklearn_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.int64)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    x = (x - x.mean(0)) / (x.std(0) + 1e-6) * alpha
    n_train = len(x) - n_test
    return Digits(x[:n_train], y[:n_train], x[n_train:], y[n_train:])


def _uninitialised_linear(fan_in: int, fan_out: int, bias: bool) -> nn.Linear:
    # skip nn.Linear's initialisation, which would draw from (and advance) the global RNG
    return nn.utils.skip_init(nn.Linear, fan_in, fan_out, bias=bias)


def digits_mlp(hidden: tuple[int, ...] = (16, 10), seed: int = 0, inputs: int = 64, classes: int = 10, bias: bool = False) -> nn.Sequential:
    """The papers' classifier W_L s(... s(W_1 x)) with LeakyReLU(0.1) (Zhao 2026, Sec. 5.2.3, 5.4.2).

    The default widths 64-16-10-10 without biases are the paper's MNIST network
    with the input layer resized to digits' 64 pixels.  Weights (and biases, with
    ``bias=True``) follow ``nn.Linear``'s default initialisation, U(-1/sqrt(fan_in),
    1/sqrt(fan_in)), drawn from a private generator seeded by ``seed``: the global
    RNG is left alone.
    """
    if not hidden or any(not isinstance(h, int) or isinstance(h, bool) or h < 1 for h in hidden):
        raise ValueError(f"hidden must be a non-empty tuple of positive ints, got {hidden!r}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    widths = (inputs, *hidden, classes)
    layers: list[nn.Module] = []
    generator = torch.Generator().manual_seed(seed)
    for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
        linear = _uninitialised_linear(fan_in, fan_out, bias)
        bound = 1.0 / fan_in**0.5  # nn.Linear's default kaiming_uniform(a=sqrt(5)) bound, and its bias bound
        with torch.no_grad():
            linear.weight.uniform_(-bound, bound, generator=generator)
            if linear.bias is not None:
                linear.bias.uniform_(-bound, bound, generator=generator)
        layers.append(linear)
        if i < len(hidden):
            layers.append(nn.LeakyReLU(NEGATIVE_SLOPE))
    return nn.Sequential(*layers)


def hidden_rescaling_sites(model: nn.Sequential) -> list[Site]:
    """One exact positive-rescaling site per hidden layer of a LeakyReLU/ReLU ``nn.Sequential`` MLP.

    For ``Linear, act, Linear, act, ..., Linear`` the hidden units of layer i can be
    scaled by c > 0 (rows of W_i and entries of its bias times c, columns of
    W_{i+1} divided by c) without changing the function (Zhao 2026, Ex. 1.2.4).  Other architectures: use
    ``teleopt.find_symmetries`` or build :class:`~teleopt.site.Site` objects by hand.
    """
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"hidden_rescaling_sites needs an nn.Sequential MLP, got {type(model).__name__}")
    modules = list(model)
    if len(modules) < 3 or len(modules) % 2 == 0:
        raise ValueError("expected Linear, activation, Linear, ..., Linear (an odd number >= 3 of modules)")
    sites = []
    for i in range(0, len(modules) - 2, 2):
        first, act, second = modules[i], modules[i + 1], modules[i + 2]
        if not isinstance(first, nn.Linear) or not isinstance(second, nn.Linear):
            raise ValueError(f"modules {i} and {i + 2} must be nn.Linear, got {type(first).__name__} and {type(second).__name__}")
        if isinstance(act, nn.LeakyReLU):
            action = get_action("positive_rescaling", activation="leaky_relu", negative_slope=act.negative_slope)
        elif isinstance(act, nn.ReLU):
            action = get_action("positive_rescaling", activation="relu")
        else:
            raise ValueError(f"module {i + 1} is {type(act).__name__}: positive rescaling needs ReLU or LeakyReLU")
        bias = None if first.bias is None else f"{i}.bias"
        sites.append(Site(action, (f"{i}.weight", bias, f"{i + 2}.weight"), name=f"rescale_hidden{i // 2 + 1}"))
    return sites
