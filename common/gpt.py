"""A small GPT (lessons 13-16): a decoder-only transformer built from lesson 12's ``TransformerBlock``.

    tokens (batch, seq) -> token embedding + position embedding -> dropout
                        -> num_layers x TransformerBlock(causal=True, dropout)
                        -> LayerNorm -> head: a linear to the vocabulary -> logits (batch, seq, vocab)

It is GPT-2's layout (Radford et al. 2019) at a size that trains on a CPU: pre-norm blocks (attention, then the
MLP, each added to its input), learned positions, a causal mask so that position i sees positions 0..i only, and
dropout on the embeddings, on the attention probabilities and on each block's two outputs. The vocabulary is
bytes (256 tokens, ``common.text``), so it needs no tokenizer. The head is not tied to the token embedding: with
tensor parallelism each can then be cut its own way.

Pipeline parallelism (``common.parallelize``, lesson 16) keeps, on each stage, a copy with only its blocks: the
first stage's copy embeds, the last one's normalizes and scores, and the parts a stage lacks are ``None``, so that
``forward`` passes activations in or out instead (as torchtitan's Llama does).

``GPT.embed(tokens, start)`` embeds a slice of the sequence that starts at position ``start``: sequence
parallelism (``common.sequence_parallel``) gives each rank its own slice. ``GPT.positions``, when set, says
which positions the tokens are at instead: context parallelism (``common.parallelize``) cuts the sequence into
zig-zag pieces that are not one range. ``next_token_loss`` is the mean
cross-entropy of predicting every next byte; its exponential is the perplexity. ``generate`` samples text.
"""

import torch
import torch.nn.functional as F
from torch import nn

from common.tensor_parallel import TransformerBlock, maybe_dropout


class GPT(nn.Module):
    """A decoder-only transformer over a vocabulary of ``vocab_size`` tokens, for sequences of up to ``context``.

    ``d_model`` is the width h, ``num_heads`` the heads a, ``num_layers`` the blocks; the MLP is 4 h wide.
    ``dropout`` is the probability of each of its dropouts in training.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        context: int = 128,
        d_model: int = 128,
        num_heads: int = 4,
        num_layers: int = 4,
        dropout: float = 0.1,
    ):
        super().__init__()
        self.context, self.dropout = context, dropout
        self.token = nn.Embedding(vocab_size, d_model)
        self.position = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(
            [TransformerBlock(d_model, num_heads, causal=True, dropout=dropout) for _ in range(num_layers)]
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        # The positions of the tokens it is given, when they are not 0..L-1: context parallelism (lesson 16) gives
        # each rank its zig-zag share of the sequence and sets them here. None: 0..L-1.
        self.positions: torch.Tensor | None = None

    def embed(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        """``tokens`` (batch, length) at positions ``start`` to ``start + length`` (or at ``self.positions``, when
        set): their embeddings plus the positions', after dropout."""
        if self.positions is None:
            positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        else:
            positions = self.positions.to(tokens.device)
        return maybe_dropout(self.token(tokens) + self.position(positions), self.dropout, self.training)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, seq, vocab)``: at position i, the scores of the token that follows token i."""
        if tokens.shape[1] > self.context:
            raise ValueError(f"a sequence of {tokens.shape[1]} tokens is longer than the context of {self.context}")
        X = self.embed(tokens) if self.token is not None else tokens  # a later pipeline stage: activations in
        for block in self.blocks:
            X = block(X)
        return self.head(self.norm(X)) if self.head is not None else X  # an earlier stage: activations out


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy, in nats, of ``logits`` (batch, seq, vocab) against the next tokens ``targets``
    (batch, seq). ``exp`` of it is the perplexity: as unsure as a uniform choice among that many tokens."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@torch.no_grad()
def generate(logits_of, prompt: torch.Tensor, new_tokens: int, window: int, temperature: float = 0.8, seed: int = 0):
    """``prompt`` (1, length) followed by ``new_tokens`` tokens sampled one at a time. ``logits_of(tokens)`` gives
    logits whose last position scores the next token (a ``GPT`` in eval mode, or a function around a split one); it
    sees the last ``window`` tokens. Each token is drawn from the softmax of those logits divided by
    ``temperature``, with a generator of its own (``seed``): the global random state is left alone, and every rank
    that samples with the same seed draws the same text."""
    generator = torch.Generator(device=prompt.device).manual_seed(seed)
    tokens = prompt
    for _ in range(new_tokens):
        logits = logits_of(tokens[:, -window:])[:, -1] / temperature
        following = torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)
        tokens = torch.cat([tokens, following], dim=1)
    return tokens
