"""Profiles of the published models for benchmarks/sim_gpu_validation.py, from their
architecture alone (no measurement): parameter shapes in registration order and FLOPs per
layer, counted from the layer formulas.

Times are in FLOP units (seconds = FLOPs x 1e-12): `longboat sim` rescales a profile's times to
the device, so only their proportions matter. Backward of a layer costs twice its forward FLOPs
(input and weight gradients; the first layer of a network has no input gradient); a gradient is
ready when backward has passed its layer, in reverse registration order; an embedding's
gradient, and a weight tied to it, is ready at the end of backward. Memory-bound layers
(normalisation, activations) count no FLOPs, so their share of the backward timeline is left
out.

    resnet50(batch, dtype)                      torchvision-style ResNet-50 v1.5, 224x224
    bert_large(batch, seq, head, dtype)         BERT-large, pretraining (MLM+NSP) or SQuAD head
    transformer_xl(size, batch, dtype)          Transformer-XL base/large on WikiText-103
"""

from __future__ import annotations

from dataclasses import dataclass, field

from longboat.sim.profile import Param, Profile

UNIT = 1e-12  # seconds per FLOP in the returned profiles (only proportions matter)


@dataclass
class Layer:
    """One layer: its parameters (name -> shape) and forward FLOPs per sample."""

    name: str
    params: dict[str, tuple[int, ...]]
    flops: float
    first: bool = False  # no input gradient (the network's first computing layer)
    tied_to_end: bool = False  # gradient ready at the end of backward (embeddings)


@dataclass
class Net:
    name: str
    layers: list[Layer] = field(default_factory=list)

    def add(self, name: str, flops: float = 0.0, **params: tuple[int, ...]) -> None:
        self.layers.append(Layer(name, params, flops))

    def profile(self, batch: int, dtype: str) -> Profile:
        """The profile at ``batch`` samples per rank, parameters in ``dtype``."""
        fwd = sum(layer.flops for layer in self.layers) * batch
        bwd_of = [(1 if layer.first else 2) * layer.flops * batch for layer in self.layers]
        bwd = sum(bwd_of)
        params, done = [], 0.0
        ready_of = [0.0] * len(self.layers)
        for i in reversed(range(len(self.layers))):
            done += bwd_of[i]
            ready_of[i] = bwd if self.layers[i].tied_to_end else done
        for layer, ready in zip(self.layers, ready_of, strict=True):
            for pname, shape in layer.params.items():
                params.append(
                    Param(f"{layer.name}.{pname}", shape, dtype, layer.name, ready * UNIT)
                )
        return Profile(
            model=self.name,
            batch=batch,
            forward_s=fwd * UNIT,
            backward_s=bwd * UNIT,
            optimizer_s=0.0,
            flops=fwd + bwd,
            params=tuple(params),
            device="cuda",
        )


def _conv(net: Net, name: str, cin: int, cout: int, k: int, hw_out: int) -> None:
    net.add(name, 2 * cin * cout * k * k * hw_out * hw_out, weight=(cout, cin, k, k))


def _bn(net: Net, name: str, c: int) -> None:
    net.add(name, 0.0, weight=(c,), bias=(c,))


def resnet50(batch: int, dtype: str = "float32") -> Profile:
    """ResNet-50 v1.5 (stride in the 3x3 convolution), 224x224 inputs, 1000 classes."""
    net = Net("resnet50")
    _conv(net, "conv1", 3, 64, 7, 112)
    net.layers[-1].first = True
    _bn(net, "bn1", 64)
    cin, hw = 64, 56
    for stage, (width, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3))):
        for block in range(blocks):
            stride = 2 if block == 0 and stage > 0 else 1
            out_hw = hw // stride
            pre = f"layer{stage + 1}.{block}"
            _conv(net, f"{pre}.conv1", cin, width, 1, hw)
            _bn(net, f"{pre}.bn1", width)
            _conv(net, f"{pre}.conv2", width, width, 3, out_hw)
            _bn(net, f"{pre}.bn2", width)
            _conv(net, f"{pre}.conv3", width, width * 4, 1, out_hw)
            _bn(net, f"{pre}.bn3", width * 4)
            if block == 0:
                _conv(net, f"{pre}.downsample.0", cin, width * 4, 1, out_hw)
                _bn(net, f"{pre}.downsample.1", width * 4)
            cin, hw = width * 4, out_hw
    net.add("fc", 2 * 2048 * 1000, weight=(1000, 2048), bias=(1000,))
    return net.profile(batch, dtype)


def _transformer_layer(net: Net, pre: str, d: int, ff: int, tokens: int, attn: float) -> None:
    net.add(f"{pre}.attention.qkv", 2 * 3 * d * d * tokens, weight=(3 * d, d), bias=(3 * d,))
    net.add(f"{pre}.attention.scores", attn)
    net.add(f"{pre}.attention.output", 2 * d * d * tokens, weight=(d, d), bias=(d,))
    net.add(f"{pre}.attention.norm", 0.0, weight=(d,), bias=(d,))
    net.add(f"{pre}.ffn.in", 2 * d * ff * tokens, weight=(ff, d), bias=(ff,))
    net.add(f"{pre}.ffn.out", 2 * ff * d * tokens, weight=(d, ff), bias=(d,))
    net.add(f"{pre}.ffn.norm", 0.0, weight=(d,), bias=(d,))


def bert_large(batch: int, seq: int, head: str = "pretraining", dtype: str = "float32") -> Profile:
    """BERT-large (24 layers, hidden 1024, 16 heads, vocabulary 30528 as NVIDIA pads it).
    ``head``: ``pretraining`` (masked LM over 15 % of the tokens, decoder tied to the word
    embedding, and next-sentence prediction) or ``squad`` (start/end logits)."""
    d, ff, vocab = 1024, 4096, 30528
    net = Net(f"bert-large-{head}-seq{seq}")
    net.add("embeddings.word", 0.0, weight=(vocab, d))
    net.layers[-1].tied_to_end = True
    net.add("embeddings.position", 0.0, weight=(512, d))
    net.layers[-1].tied_to_end = True
    net.add("embeddings.token_type", 0.0, weight=(2, d))
    net.layers[-1].tied_to_end = True
    net.add("embeddings.norm", 0.0, weight=(d,), bias=(d,))
    net.layers[-1].tied_to_end = True
    for i in range(24):
        _transformer_layer(net, f"encoder.{i}", d, ff, seq, 2 * 2 * seq * seq * d)
    net.layers[4].first = True  # the first layer computing on the embeddings' output
    if head == "squad":
        net.add("qa_outputs", 2 * d * 2 * seq, weight=(2, d), bias=(2,))
    else:
        net.add("pooler", 2 * d * d, weight=(d, d), bias=(d,))
        masked = 0.15 * seq
        net.add("cls.transform", 2 * d * d * masked, weight=(d, d), bias=(d,))
        net.add("cls.norm", 0.0, weight=(d,), bias=(d,))
        net.add("cls.decoder", 2 * d * vocab * masked, bias=(vocab,))
        net.add("cls.next_sentence", 2 * d * 2, weight=(2, d), bias=(2,))
    return net.profile(batch, dtype)


TXL = {
    # d_model, layers, d_inner, tgt_len = mem_len, div_val (NVIDIA's wt103_{base,large}.yaml)
    "base": (512, 16, 2048, 192, 1),
    "large": (1024, 18, 4096, 384, 4),
}
TXL_VOCAB, TXL_CUTOFFS = 267735, (19997, 39997, 199997)


def transformer_xl(size: str, batch: int, dtype: str = "float32") -> Profile:
    """Transformer-XL on WikiText-103 (word vocabulary of 267,735, adaptive input and softmax
    with cutoffs 19997/39997/199997 and tied weights), ``batch`` sequences of ``tgt_len`` tokens
    attending over ``tgt_len + mem_len``. Output FLOPs count the softmax head (the tail clusters
    serve the few rare-word tokens)."""
    d, layers, inner, tgt, div_val = TXL[size]
    tokens, keys = tgt, 2 * tgt
    net = Net(f"transformer-xl-{size}")
    bounds = (0, *TXL_CUTOFFS, TXL_VOCAB)
    for i in range(len(bounds) - 1):
        d_emb = d // div_val**i
        params = {"weight": (bounds[i + 1] - bounds[i], d_emb)}
        if div_val > 1:
            params["projection"] = (d, d_emb)
        net.add(f"word_emb.{i}", 0.0, **params)
        net.layers[-1].tied_to_end = True  # tied with the adaptive softmax's output layers
    for i in range(layers):
        pre = f"layers.{i}"
        net.add(f"{pre}.qkv", 2 * 3 * d * d * tokens, weight=(3 * d, d))
        net.add(f"{pre}.r_net", 2 * d * d * keys, weight=(d, d))
        net.add(f"{pre}.scores", 3 * 2 * d * keys * tokens)
        net.add(f"{pre}.o", 2 * d * d * tokens, weight=(d, d))
        net.add(f"{pre}.norm1", 0.0, weight=(d,), bias=(d,))
        net.add(f"{pre}.ff.in", 2 * d * inner * tokens, weight=(inner, d), bias=(inner,))
        net.add(f"{pre}.ff.out", 2 * inner * d * tokens, weight=(d, inner), bias=(d,))
        net.add(f"{pre}.norm2", 0.0, weight=(d,), bias=(d,))
    net.layers[len(bounds) - 1].first = True
    net.add("attn_bias", 0.0, r_w_bias=(d // 64, 64), r_r_bias=(d // 64, 64))
    head = TXL_CUTOFFS[0] + len(TXL_CUTOFFS)
    net.add("crit", 2 * d * head * tokens, cluster_weight=(3, d), cluster_bias=(3,),
            out_bias=(TXL_VOCAB,))  # fmt: skip
    return net.profile(batch, dtype)
