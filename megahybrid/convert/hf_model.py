"""The transformers model of an export: megahybrid's own GPTModel (tp = 1, a private one-process group when none
exists), its modules registered again under the Hugging Face names of megahybrid.convert.adapter, so loading the
export's weights fills the very modules the forward runs. Every mixer is covered by construction: a new one
needs only its name mapping. Sequences must be unpadded (no attention mask with zeros); generate() decodes
through megahybrid.model.decode's static inference context (the mixers' own caches).
"""
import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from megahybrid.convert import adapter, hf_config


class MegahybridConfig(PretrainedConfig):
    model_type = "megahybrid"

    def __init__(self, pattern: str = "S", mixer_options: dict | None = None, **kwargs):
        self.pattern = pattern
        self.mixer_options = mixer_options or {}
        for name in hf_config.FIELDS:
            if name in kwargs and name != "tie_word_embeddings":
                setattr(self, name, kwargs.pop(name))
        super().__init__(**kwargs)

    def model_config(self):
        return hf_config.model_config(self.to_dict())


def _attach(root: torch.nn.Module, path: str, module: torch.nn.Module) -> None:
    """Register `module` at dotted `path` under `root`, creating empty containers on the way."""
    *parents, leaf = path.split(".")
    node = root
    for part in parents:
        if not hasattr(node, part):
            node.add_module(part, torch.nn.Module())
        node = getattr(node, part)
    node.add_module(leaf, module)


class DecodeState:
    """The megatron inference context carried between generate() steps as transformers' `cache`."""

    def __init__(self, ctx):
        self.ctx = ctx

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.ctx.sequence_len_offset


class MegahybridForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = MegahybridConfig
    base_model_prefix = "model"
    _no_split_modules = []

    def __init__(self, config: MegahybridConfig):
        super().__init__(config)
        from megahybrid.convert.local import bare_model

        model_cfg = config.model_config()
        with torch.device("cpu"):  # transformers may build under a meta-device context; megatron needs real tensors
            gpt = bare_model(model_cfg)
        object.__setattr__(self, "gpt", gpt)  # not a submodule: its parameters appear once, under our names below
        for ours, theirs in adapter.module_map(model_cfg).items():
            _attach(self, theirs, gpt.get_submodule(ours))
        self.post_init()

    def _init_weights(self, module):
        """Weights come from the export (or the caller): nothing to initialize."""

    def _apply(self, fn, recurse=True):
        self.gpt._apply(fn, recurse)  # covers every registered module (they are the GPTModel's) and its buffers
        return self

    def state_dict(self, *args, **kwargs):
        """Without megatron's empty `_extra_state` entries (the exported weights have none)."""
        state = super().state_dict(*args, **kwargs)
        for key in [k for k in state if k.endswith("._extra_state")]:
            del state[key]
        return state

    def train(self, mode: bool = True):
        super().train(mode)
        self.gpt.train(mode)
        return self

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, labels=None, use_cache=None,
                **kwargs):
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("megahybrid models take unpadded sequences: pass no attention mask with zeros")
        if cache is not None or use_cache:
            return self._decode_step(input_ids, cache)
        logits = self.gpt(input_ids=input_ids, position_ids=position_ids, attention_mask=None,
                          runtime_gather_output=True)
        return CausalLMOutputWithPast(loss=self._loss(logits, labels), logits=logits)

    def _decode_step(self, input_ids, state):
        from megahybrid.model.decode import new_context, step_logits

        if not isinstance(state, DecodeState) or state.ctx.sequence_len_offset == 0:
            state = DecodeState(new_context(input_ids.shape[0], self.config.max_position_embeddings))
            tokens = input_ids
        else:
            tokens = input_ids[:, state.ctx.sequence_len_offset:]
        logits = step_logits(self.gpt, tokens, state.ctx)
        return CausalLMOutputWithPast(logits=logits, cache=state)

    @staticmethod
    def _loss(logits, labels):
        if labels is None:
            return None
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)

    def prepare_inputs_for_generation(self, input_ids, cache=None, attention_mask=None, **kwargs):
        """Whole sequence each step: _decode_step feeds the mixers only the tokens their caches have not seen."""
        return {"input_ids": input_ids, "cache": cache, "attention_mask": attention_mask,
                "use_cache": kwargs.get("use_cache", True)}

    def _update_model_kwargs_for_generation(self, outputs, model_kwargs, is_encoder_decoder=False, num_new_tokens=1):
        model_kwargs["cache"] = outputs.cache
        return model_kwargs
