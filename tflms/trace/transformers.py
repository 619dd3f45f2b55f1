"""Transformer language models from keras-hub, built from their published configurations.

Each model is a keras-hub backbone with random weights (nothing is downloaded) and a language-
model head that reuses the token embedding (keras-hub's ReversibleEmbedding), so a training step
computes logits over the whole vocabulary at every position, as causal-LM pre-training does.
BERT-large is trained the same way here (full-vocabulary logits at every position); real masked-LM
training computes them at the masked positions only, which makes this the heavier step.

Sizes are those of the released checkpoints (GPT-2: OpenAI's 355M/774M/1.5B; BERT-large uncased;
Llama 3.2 1B). keras-hub is optional (`make install` adds it; by hand see INSTALL_HINT); importing
this module does not import it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# keras-hub declares tensorflow-text, which would pull the full tensorflow wheel beside
# tensorflow-cpu: its real runtime needs come from the `models` extra, keras-hub without deps.
INSTALL_HINT = "pip install 'tflms[models]' && pip install --no-deps keras-hub==0.32.0"


@dataclass(frozen=True)
class TransformerConfig:
    family: str  # "gpt2", "bert" or "llama": which keras-hub backbone
    vocabulary_size: int
    num_layers: int
    num_heads: int
    hidden_dim: int
    intermediate_dim: int
    max_sequence_length: int  # learned position embeddings (GPT-2, BERT); RoPE has no limit
    num_key_value_heads: int = 0  # llama: grouped-query attention
    tie_word_embeddings: bool = True
    rope_max_wavelength: float = 10000.0


TRANSFORMERS: dict[str, TransformerConfig] = {
    # A two-layer GPT-2 for tests and quick demos; not a released size.
    "GPT2-tiny": TransformerConfig("gpt2", 1024, 2, 4, 64, 256, 1024),
    "GPT2-124M": TransformerConfig("gpt2", 50257, 12, 12, 768, 3072, 1024),
    "GPT2-355M": TransformerConfig("gpt2", 50257, 24, 16, 1024, 4096, 1024),
    "GPT2-774M": TransformerConfig("gpt2", 50257, 36, 20, 1280, 5120, 1024),
    "GPT2-1.5B": TransformerConfig("gpt2", 50257, 48, 25, 1600, 6400, 1024),
    "BERT-large": TransformerConfig("bert", 30522, 24, 16, 1024, 4096, 512),
    # Llama 3.2 1B: grouped-query attention (8 KV heads), SwiGLU, RoPE, tied embeddings.
    "Llama-1B": TransformerConfig(
        "llama", 128256, 16, 32, 2048, 8192, 131072, 8, True, rope_max_wavelength=500000.0
    ),
}


def build_language_model(name: str, sequence_length: int) -> Any:
    """A Keras model mapping token ids (batch, sequence_length) to logits over the vocabulary."""
    import keras

    try:
        import keras_hub
    except ImportError as exc:
        raise ImportError(
            f"{name} is a keras-hub model and keras-hub is not installed: {INSTALL_HINT}"
        ) from exc

    config = TRANSFORMERS[name]
    if config.family == "llama":
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=config.vocabulary_size,
            num_layers=config.num_layers,
            num_query_heads=config.num_heads,
            hidden_dim=config.hidden_dim,
            intermediate_dim=config.intermediate_dim,
            num_key_value_heads=config.num_key_value_heads,
            rope_max_wavelength=config.rope_max_wavelength,
            layer_norm_epsilon=1e-5,
            tie_word_embeddings=config.tie_word_embeddings,
        )
    else:
        constructor = (
            keras_hub.models.GPT2Backbone
            if config.family == "gpt2"
            else keras_hub.models.BertBackbone
        )
        backbone = constructor(
            vocabulary_size=config.vocabulary_size,
            num_layers=config.num_layers,
            num_heads=config.num_heads,
            hidden_dim=config.hidden_dim,
            intermediate_dim=config.intermediate_dim,
            # Random weights: a longer sequence than the checkpoint's just grows the table.
            max_sequence_length=max(config.max_sequence_length, sequence_length),
        )

    class LanguageModel(keras.Model):
        """Backbone plus the tied output projection; every position is a real token."""

        def __init__(self, backbone: Any) -> None:
            super().__init__(name=f"{config.family}_lm")
            self.backbone = backbone

        def call(self, token_ids: Any, training: bool = False) -> Any:
            # Computed from the ids rather than ones_like/zeros_like: TensorFlow folds a small
            # ones_like into a constant (under 1000 elements), so the step graph at batch 1 and
            # 512 tokens would differ from batch 2's and batch scaling could not be measured.
            inputs = {
                "token_ids": token_ids,
                "padding_mask": keras.ops.greater_equal(token_ids, 0),
            }
            if config.family == "bert":
                inputs["segment_ids"] = keras.ops.minimum(token_ids, 0)
            hidden = self.backbone(inputs, training=training)
            if config.family == "bert":
                hidden = hidden["sequence_output"]
            return self.backbone.token_embedding(hidden, reverse=True)

    model = LanguageModel(backbone)
    model.build((None, sequence_length))
    return model


@contextlib.contextmanager
def variables_without_storage() -> Iterator[None]:
    """Keras variables created inside get a TensorFlow resource handle with their shape and dtype
    but no value: nothing is allocated or initialized, so a 1.5B-parameter model and its Adam
    slots (24 GB in fp32) can be traced on a machine with less memory. Tracing only needs the
    handles; running the traced step would fail on the first read. The traced graph is the same
    as with materialized variables (tests/test_trace_transformers.py compares them)."""
    from keras.src.backend.tensorflow import core
    from tensorflow.python.ops.resource_variable_ops import UninitializedVariable

    original = core.Variable._initialize

    def initialize_without_storage(self: Any, value: Any) -> None:
        # An initializer (callable) would allocate the variable's bytes; a value given as an
        # array (a step counter, a seed) already holds them and is kept as it is.
        if not callable(value):
            original(self, value)
            return
        self._value = UninitializedVariable(
            shape=self._shape,
            dtype=self._dtype,
            trainable=self.trainable,
            name=self.name,
        )

    core.Variable._initialize = initialize_without_storage
    try:
        yield
    finally:
        core.Variable._initialize = original
