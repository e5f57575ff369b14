"""A pretraining stage whose network is a tiny Hugging Face vision-language model (``models/vlm.py``),
for the weights tests: ``init_from`` a Hugging Face directory, and export back to one."""

from uma_lightning.models.vlm import VLMModelConfig, VLMTokenModel
from uma_lightning.modules import PretrainModule


class VLMPretrain(PretrainModule):
    def __init__(self, directory: str, **kwargs):
        super().__init__(**kwargs)
        self.directory = directory

    def build_model(self):
        return VLMTokenModel(
            VLMModelConfig(self.directory, self.spec, max_text_len=8, n_action_bins=self.hparams.n_action_bins)
        )
