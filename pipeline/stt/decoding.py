"""Batched greedy RNNT decoding with explicit per-slot prediction-network state.

Label looping, frame-synchronous: every iteration each row either emits a label (and stays
on its frame, at most ``max_symbols`` times) or advances one frame, exactly as NeMo's
``greedy_batch`` does; so a chunk-by-chunk run with carried state equals one offline pass.
"""
from __future__ import annotations

import torch
from torch import nn


class PredictionStep(nn.Module):
    """One prediction-network step ``(label, hc) -> (g, hc)`` for RNNTDecoder's LSTM (hc = [h; c]).

    ``unrolled=True`` runs ``torch.lstm_cell`` layer by layer (no cuDNN/oneDNN RNN setup per
    call, which dominates at sequence length 1); otherwise the library ``nn.LSTM``.
    """

    def __init__(self, decoder, unrolled: bool = True):
        super().__init__()
        self.embed = decoder.prediction["embed"]
        rnn = decoder.prediction["dec_rnn"]
        self.lstm: nn.LSTM = rnn.lstm if hasattr(rnn, "lstm") else rnn
        plain = (
            isinstance(self.lstm, nn.LSTM)
            and not self.lstm.batch_first
            and not self.lstm.bidirectional
            and self.lstm.proj_size == 0
            and self.lstm.bias
            and type(rnn).__name__ == "LSTMDropout"
        )
        self.unrolled = bool(unrolled and plain)
        self.rnn = rnn
        self.num_layers = self.lstm.num_layers
        self.hidden = self.lstm.hidden_size

    def forward(self, labels: torch.Tensor, hc: torch.Tensor):
        """``hc``: the LSTM state as one tensor [2L, B, H] (h of every layer, then c); returns (g, hc)."""
        x = self.embed(labels)  # [B, H_in]
        L = self.num_layers
        if self.unrolled:
            hs, cs = [], []
            for layer in range(L):
                hl, cl = torch.lstm_cell(
                    x,
                    (hc[layer], hc[L + layer]),
                    getattr(self.lstm, f"weight_ih_l{layer}"),
                    getattr(self.lstm, f"weight_hh_l{layer}"),
                    getattr(self.lstm, f"bias_ih_l{layer}"),
                    getattr(self.lstm, f"bias_hh_l{layer}"),
                )
                hs.append(hl)
                cs.append(cl)
                x = hl
            return x, torch.stack(hs + cs)
        g, (h2, c2) = self.rnn(x.unsqueeze(0), (hc[:L], hc[L:]))
        return g.squeeze(0), torch.cat([h2, c2])


def joint_logits(joint, f: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Joint scores [B, T, V] of projected encoder frames ``f`` [B, T, Hj] with one projected
    prediction ``g`` [B, Hj] per row: NeMo's ``joint_after_projection`` without the U axis and without
    its CPU-only log-softmax (a per-row shift that leaves the argmax alone)."""
    if joint.training or joint.is_adapter_available():
        return joint.joint_after_projection(f, g[:, None, :])[:, :, 0, :]
    return joint.joint_net(f + g[:, None, :])


def _emit_step(joint, pred: PredictionStep, blank: int, emit, labels, g, hc):
    """Advance the prediction state of the rows that emit ``labels`` (others keep theirs)."""
    g_new, hc_new = pred(torch.where(emit, labels, blank), hc)
    g = torch.where(emit[:, None], joint.project_prednet(g_new), g)
    return g, torch.where(emit[None, :, None], hc_new, hc)


def _stacked(out_labels: list, out_frames: list, B: int, dev, g, hc):
    """(labels [B, I], frames [B, I], g, hc) from the per-iteration lists."""
    if not out_labels:
        empty = torch.empty(B, 0, dtype=torch.long, device=dev)
        return empty, empty, g, hc
    return torch.stack(out_labels, 1), torch.stack(out_frames, 1), g, hc


@torch.inference_mode()
def frame_loop_decode_chunk(
    joint,
    pred: PredictionStep,
    blank: int,
    max_symbols: int,
    f: torch.Tensor,  # [B, T, Hj] projected encoder output of this chunk
    f_len: torch.Tensor,  # [B] valid frames
    g: torch.Tensor,  # [B, Hj] projected prediction output for the last label
    hc: torch.Tensor,  # [2L, B, H] LSTM state
    check_every: int = 4,
):
    """Greedy RNNT over one chunk by frame looping (an iteration per frame or emitted label, the
    joint on one frame per row); return (labels [B, I] with -1 where nothing was emitted,
    frame [B, I], g, hc). The classic algorithm, kept as the reference that label looping is
    tested against and as ``STTConfig.decoder: frame_loop``.

    Runs ``T`` iterations unconditionally (each row needs at least its frame count), then checks
    for completion only every ``check_every`` iterations, so the host waits on the device rarely.
    """
    # Over 40 lines as one function: one decoding loop; split, its state would be passed around.
    B, T, _ = f.shape
    dev = f.device
    rows = torch.arange(B, device=dev)
    t = torch.zeros(B, dtype=torch.long, device=dev)
    sym = torch.zeros(B, dtype=torch.long, device=dev)
    last_t = max(T - 1, 0)
    out_labels, out_frames = [], []
    max_iters = T * (max_symbols + 1)
    it = 0
    while it < max_iters:
        if it >= T and (it - T) % check_every == 0 and not bool((t < f_len).any()):
            break
        active = t < f_len
        ft = f[rows, t.clamp(max=last_t)]  # [B, Hj]
        k = joint_logits(joint, ft[:, None, :], g)[:, 0].argmax(dim=-1)
        emit = active & (k != blank)
        out_labels.append(torch.where(emit, k, -1))
        out_frames.append(t)
        g, hc = _emit_step(joint, pred, blank, emit, k, g, hc)
        sym = torch.where(emit, sym + 1, sym)
        adv = active & (~emit | (sym >= max_symbols))
        sym = torch.where(adv, 0, sym)
        t = t + adv.long()
        it += 1
    return _stacked(out_labels, out_frames, B, dev, g, hc)


@torch.inference_mode()
def label_loop_decode_chunk(
    joint,
    pred: PredictionStep,
    blank: int,
    max_symbols: int,
    f: torch.Tensor,  # [B, T, Hj] projected encoder output of this chunk
    f_len: torch.Tensor,  # [B] valid frames
    g: torch.Tensor,  # [B, Hj]
    hc: torch.Tensor,  # [2L, B, H]
    check_every: int | None = None,
):
    """``frame_loop_decode_chunk`` by label looping: one iteration per emitted label instead of per frame.

    With the prediction state fixed, frame looping walks over blank frames until the first frame
    whose best label is not blank; here the joint is evaluated on every frame of the chunk at once
    and each row jumps to its first non-blank frame at or after its position. Same decisions, same
    ``max_symbols`` rule (after that many labels on one frame, move to the next), so the same labels
    and frames; about (labels per row + 1) iterations instead of (frames + labels): fewer, larger
    operations, which is what an overhead-bound step wants. The joint over all frames costs
    ``T`` times a one-frame joint, so for a large vocabulary and joint on a slow device the frame
    loop can be cheaper (``STTConfig.decoder``). A row that finds no label is done for the chunk
    (its prediction state only changes when it emits). "Same decisions" holds as long as the joint's
    matmul rounds a row the same whatever the number of rows (true of the CPU kernels here, tested);
    a GPU library may pick another kernel for B*T rows than for B, so a near-tie can break the other
    way there, as it can between any two GPU runs of different batch sizes.
    """
    # Over 40 lines as one function: one decoding loop; split, its state would be passed around.
    B, T, _ = f.shape
    dev = f.device
    if check_every is None:  # the end-of-chunk test reads a flag on the host: free on a CPU, a sync on a GPU
        check_every = 1 if dev.type == "cpu" else 3
    frame = torch.arange(T, device=dev)[None, :]
    valid = frame < f_len[:, None]
    t = torch.zeros(B, dtype=torch.long, device=dev)
    sym = torch.zeros(B, dtype=torch.long, device=dev)  # labels emitted at frame t so far
    out_labels, out_frames = [], []
    for it in range(T * max_symbols + 1):  # each iteration emits >= 1 label or ends every row
        k = joint_logits(joint, f, g).argmax(dim=-1)  # [B, T]
        cand = (k != blank) & valid & (frame >= t[:, None])
        at = cand.to(torch.uint8).argmax(dim=1)  # first candidate frame (first maximum); 0 if none
        emit = cand.gather(1, at[:, None])[:, 0]
        if it % check_every == 0 and not bool(emit.any()):
            break
        lab = k.gather(1, at[:, None])[:, 0]
        out_labels.append(torch.where(emit, lab, -1))
        out_frames.append(at)
        g, hc = _emit_step(joint, pred, blank, emit, lab, g, hc)
        sym = torch.where(at == t, sym, 0) + 1
        step_on = sym >= max_symbols
        t = torch.where(emit, at + step_on, f_len)
        sym = sym.masked_fill(step_on, 0)
    return _stacked(out_labels, out_frames, B, dev, g, hc)
