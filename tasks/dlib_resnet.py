"""dlib's face-recognition ResNet (``dlib_face_recognition_resnet_model_v1.dat``) in torch.

The network is the ``anet_type`` of dlib's ``examples/dnn_face_recognition_ex.cpp``::

    loss_metric<fc_no_bias<128, avg_pool_everything<
        alevel0<alevel1<alevel2<alevel3<alevel4<
        max_pool<3,3,2,2, relu<affine<con<32,7,7,2,2, input_rgb_image_sized<150>>>>>>>>>>>>>

with ``ares<N>`` (conv 3x3 → affine → relu → conv 3x3 → affine, plus the input, then relu)
and ``ares_down<N>`` (the same with a stride-2 first conv, and a 2x2 stride-2 average pool
of the input as the shortcut): alevel4 = 3 x ares<32>, alevel3 = ares_down<64> + 3 x
ares<64>, alevel2 = ares_down<128> + 2 x ares<128>, alevel1 = ares_down<256> + 2 x
ares<256>, alevel0 = ares_down<256>. ``affine`` is dlib's frozen batch norm (per-channel
``x * gamma + beta``); it is folded here into the convolution before it.

dlib's rules that a straight port would miss:

* a convolution or pooling with stride 2 has no padding (``con_``'s default padding is
  ``stride != 1 ? 0 : size / 2``), so a 3x3 stride-2 conv and the 2x2 stride-2 pool of
  the shortcut can disagree by one row/column; ``add_prev`` then adds the two tensors
  zero-padded at the bottom/right (and along channels, 32 → 64 etc.) to the larger shape;
* the input is ``(pixel - channel mean) / 256`` in RGB order, means from the file;
* the 128-d output is the descriptor as is (``loss_metric`` does not normalise it).

``load_dlib_resnet`` reads every weight from the ``.dat`` file itself (dlib's binary
serialization: variable-length integers, floats as mantissa/exponent pairs, tensors as
raw little-endian float32) and checks that its layer sequence is exactly this network; a
file that is not raises ``ModelUnavailable``. Nothing here imports dlib.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from torch import nn

from tasks.errors import ModelUnavailable

INPUT_SIZE = 150
DESCRIPTOR_SIZE = 128

F32 = npt.NDArray[np.float32]


class DlibFormatError(ValueError):
    """The bytes are not the dlib serialization this reader expects (internal; the
    loader reports it as ``ModelUnavailable``)."""


# ---------------------------------------------------------------------------------------
# dlib's serialization primitives (dlib/serialize.h, dlib/float_details.h, tensor.h)


class _Reader:
    """A cursor over the file's bytes with dlib's primitive decoders."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise DlibFormatError(f"truncated at byte {self.pos} (wanted {n} more)")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def integer(self) -> int:
        """A variable-length integer: a control byte (low 4 bits: byte count, 0x80:
        negative) then that many little-endian magnitude bytes."""
        control = self.take(1)[0]
        size = control & 0x0F
        if size > 8 or control & 0x70:
            raise DlibFormatError(f"bad integer control byte {control:#x} at {self.pos - 1}")
        value = int.from_bytes(self.take(size), "little")
        return -value if control & 0x80 else value

    def boolean(self) -> bool:
        """A bool: the ASCII character '1' or '0'."""
        char = self.take(1)
        if char not in (b"0", b"1"):
            raise DlibFormatError(f"bad bool {char!r} at {self.pos - 1}")
        return char == b"1"

    def real(self) -> float:
        """A float or double: ``mantissa * 2**exponent`` (int64, int16; exponents 32000+
        mean inf, -inf, nan)."""
        mantissa, exponent = self.integer(), self.integer()
        if exponent >= 32000:
            return {32000: float("inf"), 32001: float("-inf")}.get(exponent, float("nan"))
        return float(np.ldexp(float(mantissa), exponent))

    def string(self) -> str:
        """A length-prefixed string."""
        length = self.integer()
        if length < 0:
            raise DlibFormatError(f"negative string length at {self.pos}")
        return self.take(length).decode("latin-1")

    def expect(self, *versions: str) -> str:
        """A layer's version string, which must be one of ``versions``."""
        found = self.string()
        if found not in versions:
            raise DlibFormatError(f"expected {' or '.join(versions)!r}, found {found!r}")
        return found

    def tensor(self) -> F32:
        """A resizable_tensor (version 2): num_samples, k, nr, nc, then float32 LE."""
        version = self.integer()
        if version != 2:
            raise DlibFormatError(f"unsupported tensor version {version}")
        shape = tuple(self.integer() for _ in range(4))
        if min(shape) < 0:
            raise DlibFormatError(f"negative tensor shape {shape}")
        count = int(np.prod(shape))
        values = np.frombuffer(self.take(4 * count), dtype="<f4")
        return values.astype(np.float32).reshape(shape)

    def alias_shape(self) -> tuple[int, int, int, int]:
        """An alias_tensor: only the shape of a view into a layer's parameter tensor."""
        if self.integer() != 1:
            raise DlibFormatError("unsupported alias_tensor version")
        n, k, nr, nc = (self.integer() for _ in range(4))
        return n, k, nr, nc


# ---------------------------------------------------------------------------------------
# The layers as read from the file


@dataclass(frozen=True)
class Conv:
    """``con_``: filters (out, in, kh, kw), biases (out,), stride and padding."""

    weight: F32
    bias: F32
    stride: int
    padding: int


@dataclass(frozen=True)
class Affine:
    """``affine_`` in conv mode: per-channel ``x * gamma + beta``."""

    gamma: F32
    beta: F32


@dataclass(frozen=True)
class Pool:
    """``max_pool_`` / ``avg_pool_``: window 0 means the whole input."""

    kind: str  # "max" or "avg"
    size: int
    stride: int
    padding: int


@dataclass(frozen=True)
class Relu:
    """``relu_``."""


@dataclass(frozen=True)
class AddPrev:
    """``add_prev_``: adds the tagged tensor (zero-padded to the larger shape)."""


@dataclass(frozen=True)
class Linear:
    """``fc_`` without bias: weight (num_inputs, num_outputs)."""

    weight: F32


Layer = Conv | Affine | Pool | Relu | AddPrev | Linear


@dataclass(frozen=True)
class DlibNetFile:
    """What the file holds: the input layer's channel means and the computational layers
    from input to output (tag and skip layers carry no data and are dropped)."""

    channel_means: tuple[float, float, float]
    layers: list[Layer]


def _read_conv(r: _Reader, version: str) -> Conv:
    params = r.tensor().reshape(-1)
    num_filters = r.integer()
    nr, nc = r.integer(), r.integer()
    stride_y, stride_x = r.integer(), r.integer()
    pad_y, pad_x = r.integer(), r.integer()
    filters = r.alias_shape()
    biases = r.alias_shape()
    for _ in range(4):  # learning-rate and weight-decay multipliers
        r.real()
    use_bias = r.boolean() if version in ("con_5", "con_6") else True
    use_relu = r.boolean() if version == "con_6" else False
    if (nr, nc) != filters[2:] or stride_y != stride_x or pad_y != pad_x or use_relu:
        raise DlibFormatError("unsupported convolution shape")
    size = int(np.prod(filters))
    n_bias = num_filters if use_bias else 0
    if filters[0] != num_filters or params.size != size + n_bias or biases[1] != n_bias:
        raise DlibFormatError("convolution parameters do not match their shapes")
    weight = params[:size].reshape(filters)
    bias = params[size:] if use_bias else np.zeros(num_filters, np.float32)
    return Conv(weight, bias, stride_y, pad_y)


def _read_affine(r: _Reader) -> Affine:
    params = r.tensor().reshape(-1)
    gamma, beta = r.alias_shape(), r.alias_shape()
    r.integer()  # mode: the per-channel shape of gamma says it is conv mode
    channels = gamma[1]
    if gamma != (1, channels, 1, 1) or beta != gamma or params.size != 2 * channels:
        raise DlibFormatError("affine layer is not per-channel")
    return Affine(params[:channels], params[channels:])


def _read_pool(r: _Reader, version: str) -> Pool:
    kind = "max" if version.startswith("max") else "avg"
    nr, nc = r.integer(), r.integer()
    stride_y, stride_x = r.integer(), r.integer()
    pad_y, pad_x = r.integer(), r.integer()
    if nr != nc or stride_y != stride_x or pad_y != pad_x:
        raise DlibFormatError("unsupported pooling shape")
    return Pool(kind, nr, stride_y, pad_y)


def _read_fc(r: _Reader, version: str) -> Linear:
    num_outputs, num_inputs = r.integer(), r.integer()
    params = r.tensor().reshape(-1)
    weights = r.alias_shape()
    r.alias_shape()  # biases
    bias_mode = r.integer()
    for _ in range(4):
        r.real()
    if version == "fc_3":
        r.boolean()  # use_bias: the bias mode below already says there is none
    if bias_mode != 1 or weights[:2] != (num_inputs, num_outputs):
        raise DlibFormatError("expected fc_no_bias")  # FC_NO_BIAS == 1
    if params.size != num_inputs * num_outputs:
        raise DlibFormatError("fc parameters do not match their shape")
    return Linear(params.reshape(num_inputs, num_outputs))


def _read_layer(r: _Reader) -> Layer:
    """One layer's details, dispatched on its version string."""
    version = r.string()
    if version in ("con_4", "con_5", "con_6"):
        return _read_conv(r, version)
    if version == "affine_":
        return _read_affine(r)
    if version in ("fc_2", "fc_3"):
        return _read_fc(r, version)
    if version in ("max_pool_2", "avg_pool_2"):
        return _read_pool(r, version)
    if version == "relu_":
        return Relu()
    if version == "add_prev_":
        return AddPrev()
    raise DlibFormatError(f"unsupported layer {version!r}")


def _skip_layer_state(r: _Reader, tensors: int) -> None:
    """The add_layer bookkeeping after a layer's details: three bools and some cached
    tensors (outputs and gradients, empty in a saved model)."""
    for _ in range(3):
        r.boolean()
    for _ in range(tensors):
        r.tensor()


def read_dlib_net(data: bytes) -> DlibNetFile:
    """Parse a serialized ``loss_metric`` network into its layers (input to output).

    dlib writes a network outside-in: each ``add_layer`` writes its version (2), then its
    whole subnetwork, then its own details; ``add_tag_layer``/``add_skip_layer`` write a
    version (1) and their subnetwork; the bottom ``add_layer`` (version 3) holds the input
    layer. So the versions are read down to the input layer, then the details come back
    up in input-to-output order."""
    r = _Reader(data)
    if r.integer() != 1:
        raise DlibFormatError("not a dlib add_loss_layer")
    r.expect("loss_metric_", "loss_metric_2")
    for _ in range(2):  # margin and distance threshold (training only)
        r.real()
    wrappers: list[int] = []
    while (version := r.integer()) in (1, 2):
        wrappers.append(version)
    if version != 3:
        raise DlibFormatError(f"unexpected add_layer version {version}")
    r.expect("input_rgb_image_sized")
    means = (r.real(), r.real(), r.real())
    if (r.integer(), r.integer()) != (INPUT_SIZE, INPUT_SIZE):
        raise DlibFormatError("input is not 150 x 150")
    layers = [_read_layer(r)]
    _skip_layer_state(r, tensors=3)
    r.integer()  # sample expansion factor
    for version in reversed(wrappers):
        if version == 2:
            layers.append(_read_layer(r))
            _skip_layer_state(r, tensors=3)
    if r.pos != len(data):
        raise DlibFormatError(f"{len(data) - r.pos} bytes left after the network")
    return DlibNetFile(means, layers)


# ---------------------------------------------------------------------------------------
# The torch network


def _folded_conv(conv: Conv, affine: Affine) -> nn.Conv2d:
    """``affine(conv(x))`` as one convolution (the frozen scale folded into the filters)."""
    out_channels, in_channels, size, _ = conv.weight.shape
    layer = nn.Conv2d(in_channels, out_channels, size, conv.stride, conv.padding)
    weight = conv.weight * affine.gamma[:, None, None, None]
    bias = conv.bias * affine.gamma + affine.beta
    layer.weight = nn.Parameter(torch.from_numpy(np.ascontiguousarray(weight, dtype=np.float32)))
    layer.bias = nn.Parameter(torch.from_numpy(np.ascontiguousarray(bias, dtype=np.float32)))
    return layer


def add_zero_padded(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """dlib's ``add_prev``: ``a + b`` over the larger of each dimension, each tensor
    zero-padded at the end of channels, rows and columns."""
    if a.shape == b.shape:
        return a + b
    channels, rows, cols = (max(a.shape[i], b.shape[i]) for i in (1, 2, 3))

    def pad(t: torch.Tensor) -> torch.Tensor:
        return F.pad(t, (0, cols - t.shape[3], 0, rows - t.shape[2], 0, channels - t.shape[1]))

    return pad(a) + pad(b)


class Residual(nn.Module):
    """dlib's ``ares`` / ``ares_down`` block (affine layers folded into the convs)."""

    def __init__(self, conv1: nn.Conv2d, conv2: nn.Conv2d, down: bool) -> None:
        super().__init__()
        self.conv1 = conv1
        self.conv2 = conv2
        self.down = down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv2(F.relu(self.conv1(x)))
        shortcut = F.avg_pool2d(x, 2, 2) if self.down else x
        return F.relu(add_zero_padded(y, shortcut))


class DlibResNet(nn.Module):
    """dlib_face_recognition_resnet_model_v1: (n, 150, 150, 3) uint8 RGB chips (as
    ``dlib.get_face_chip`` makes them) → (n, 128) descriptors."""

    mean: torch.Tensor

    def __init__(
        self,
        channel_means: tuple[float, float, float],
        stem: nn.Conv2d,
        blocks: list[Residual],
        fc: nn.Linear,
    ) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(channel_means, dtype=torch.float32))
        self.stem = stem
        self.blocks = nn.Sequential(*blocks)
        self.fc = fc

    @property
    def device(self) -> torch.device:
        """Where the weights are (chips must be sent there)."""
        return self.fc.weight.device

    def forward(self, chips: torch.Tensor) -> torch.Tensor:
        x = (chips.float() - self.mean) / 256.0
        # The chips are NHWC: as a channels-last NCHW view they need no copy, and the
        # convolutions of a channels-last network run about 30 % faster on the CPU.
        x = x.permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)
        x = F.max_pool2d(F.relu(self.stem(x)), 3, 2)
        x = self.blocks(x)
        return self.fc(x.mean(dim=(2, 3)))


L = TypeVar("L", Conv, Affine, Pool, Relu, AddPrev, Linear)

STAGES = [(32, 3, False), (64, 4, True), (128, 3, True), (256, 3, True), (256, 1, True)]
"""(channels, blocks, whether the first block halves the resolution), input to output:
alevel4 … alevel0."""


def _pop(layers: list[Layer], kind: type[L]) -> L:
    """The next layer, which must be a ``kind``."""
    layer = layers.pop(0) if layers else None
    if not isinstance(layer, kind):
        raise DlibFormatError(f"expected {kind.__name__}, found {type(layer).__name__}")
    return layer


def build_dlib_resnet(net: DlibNetFile) -> DlibResNet:
    """The torch network of ``net``'s layers, checking they are exactly this ResNet."""
    layers = list(net.layers)
    stem = _folded_conv(_pop(layers, Conv), _pop(layers, Affine))
    _pop(layers, Relu)
    if _pop(layers, Pool) != Pool("max", 3, 2, 0):
        raise DlibFormatError("unexpected stem pooling")
    blocks: list[Residual] = []
    for channels, count, first_down in STAGES:
        for index in range(count):
            conv1 = _folded_conv(_pop(layers, Conv), _pop(layers, Affine))
            _pop(layers, Relu)
            conv2 = _folded_conv(_pop(layers, Conv), _pop(layers, Affine))
            down = first_down and index == 0
            if down and _pop(layers, Pool) != Pool("avg", 2, 2, 0):
                raise DlibFormatError("unexpected shortcut pooling")
            _pop(layers, AddPrev)
            _pop(layers, Relu)
            if conv2.out_channels != channels or conv1.stride != ((2, 2) if down else (1, 1)):
                raise DlibFormatError("unexpected residual block shape")
            blocks.append(Residual(conv1, conv2, down))
    if _pop(layers, Pool) != Pool("avg", 0, 1, 0):
        raise DlibFormatError("expected avg_pool_everything")
    weight = _pop(layers, Linear).weight
    if layers or weight.shape != (256, DESCRIPTOR_SIZE):
        raise DlibFormatError("unexpected network head")
    fc = nn.Linear(weight.shape[0], weight.shape[1], bias=False)
    fc.weight = nn.Parameter(torch.from_numpy(np.ascontiguousarray(weight.T, dtype=np.float32)))
    return DlibResNet(net.channel_means, stem, blocks, fc)


def load_dlib_resnet(path: str | Path) -> DlibResNet:
    """The network in ``path`` (a verified ``dlib_face_recognition_resnet_model_v1.dat``)
    as a float32 torch module (channels-last weights) in eval mode on the CPU;
    ``ModelUnavailable`` when the file cannot be read as that network."""
    path = Path(path)
    try:
        net = build_dlib_resnet(read_dlib_net(path.read_bytes()))
    except (OSError, DlibFormatError) as exc:
        raise ModelUnavailable(detail=f"{path.name}: not a readable dlib ResNet ({exc})") from exc
    net.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    return net.eval()
