"""Acceptance test of :func:`condinit.apply`'s coverage: every architecture the installed
transformers can build from a default config, timm's main ViT families and torch.nn's attention
modules are conditioned as the method says, or are listed with the reason: in :data:`REFUSED`
(the method has no direct reading of the model's attention: latent attention, "attention" that is
not a softmax over keys) or in :data:`NOT_CHECKED` (this sweep cannot build, run or read the model:
a config its shrinking breaks, an input it does not build, attention it does not intercept).

By default every architecture that is not listed is swept (about 90 s on two busy CPU cores);
``CONDINIT_COVERAGE=sample`` sweeps a fixed sample instead (:data:`MAIN_FAMILIES` plus every
``SAMPLE_STRIDE``-th architecture, about half the time).

The check does not use condinit's discovery, adapters or report: ``tests/coverage_models.py`` finds
the attention layers by intercepting where attention is computed and reads each layer's Q/K/V rows
and head split from gradients (see its docstring). A model passes when every attention layer found
has semi-orthogonal Q and K blocks per head, V equal to the rectangular identity in the order the
attention reads it, zero Q/K/V biases, and every other parameter and buffer unchanged bit for bit;
or, for a model with no attention at all, when ``condinit.apply`` refuses it with "no attention".

``python tools/coverage_table.py`` runs the same sweep and writes the README's "Which models" table.
"""
from __future__ import annotations

import functools
import os

import pytest
import torch

import condinit
from coverage_models import architectures, build_hf, check_conditioned, hf_run, read_model, state_snapshot, verify

pytestmark = pytest.mark.usefixtures("one_thread")

# Architectures that are not conditioned, and why: the method has no direct reading of their
# attention (latent attention), or their "attention" is not a softmax over keys.
MLA = ("multi-head latent attention (DeepSeek MLA): Q, K and V are products of low-rank factors, so the"
       " method's per-head W_Q, W_K, W_V have no direct reading")
# Latent attention whose factors condinit conditions on request (mla="factors"): refused by default,
# read through each head's map by test_latent_attention_by_factors.
MLA_FACTORS = ("multi-head latent attention (Q, K, V products of low-rank factors): refused by default; conditioned "
               "by factors with mla=\"factors\" (condinit init --mla factors), each head's effective map checked "
               "from the module's forward")

REFUSED = {
    "timm:xcit": "XCiT's cross-covariance attention is a softmax over channels (k^T q), not over tokens",
    "transformers:axk1": MLA,
    "transformers:axk2": MLA,
    "transformers:conditional_detr":
        "Conditional DETR's decoder query is the sum of a content and a positional projection: no single "
        "W_Q",
    "transformers:dab-detr":
        "DAB-DETR's decoder query and key are sums of content and positional projections: no single W_Q, "
        "W_K",
    "transformers:deepseek_v2": MLA_FACTORS,
    "transformers:deepseek_v3": MLA_FACTORS,
    "transformers:deepseek_v32": MLA,
    "transformers:deepseek_v4": MLA,
    "transformers:dots3_note": MLA,
    "transformers:dots3_note_text": MLA,
    "transformers:glm4_moe_lite": MLA_FACTORS,
    "transformers:glm_moe_dsa": MLA,
    "transformers:groupvit":
        "GroupViT's assignment attention is a hard Gumbel-softmax over the group (query) axis, not a "
        "softmax over keys",
    "transformers:hy_v4": MLA,
    "transformers:hy_v4_vl": MLA,
    "transformers:hy_v4_vl_text": MLA,
    "transformers:kimi_k25": MLA,
    "transformers:kimi_linear": MLA,
    "transformers:longcat_flash": MLA,
    "transformers:minicpm3": MLA,
    "transformers:mistral4": MLA,
    "transformers:mistral_large4": MLA,
    "transformers:mistral_large4_text": MLA,
    "transformers:mra":
        "MRA approximates attention block-sparsely at several resolutions: not a full softmax attention",
    "transformers:patchtsmixer":
        "PatchTSMixer's 'gated attention' is a softmax gate over features inside an MLP: no query, key or "
        "value",
    "transformers:sarvam_mla": MLA,
    "transformers:slanet": "SLANet's attention is additive (Bahdanau) inside a GRU cell: no query-key dot product",
    "transformers:slanext": "SLANeXt's attention is additive (Bahdanau) inside a GRU cell: no query-key dot product",
    "transformers:swiftformer":
        "SwiftFormer's efficient additive attention has a learned global query and no value projection",
    "transformers:yoso":
        "YOSO approximates attention by LSH-based Bernoulli sampling: there is no softmax over the keys",
    "transformers:youtu": MLA_FACTORS,
    "transformers:zaya":
        "Zaya's compressed convolutional attention passes Q and K through a grouped convolution: no "
        "single W_Q, W_K",
}

# Architectures this sweep cannot run or read, and why: its limits, not condinit's. Most are inputs it
# does not build (a model needing bounding boxes, a vision tower needing its own patch grid) or
# configs its generic shrinking breaks; the error is the model's own.
NO_INPUT = "the sweep builds no input its forward accepts: "
NO_BUILD = "does not build from the sweep's shrunk default config: "
OVER_CAP = ("its shrunk model is still over the sweep's time or memory cap (a size "
            "attribute the shrinker does not know)")
DROPS_ATTENTION = "the sweep's shrunk config drops its attention layers "

NOT_CHECKED = {
    "transformers:align": NO_INPUT + "RuntimeError: mat1 and mat2 shapes cannot be multiplied (1x32 and 640x1)",
    "transformers:apertus1p5":
        NO_INPUT
        + "RuntimeError: permute(sparse_coo): number of dimensions in the tensor input does not match the "
        "length of the desired ordering of dimensions i.e. input.dim() = 2 is not equal to len(dims) = 3",
    "transformers:aria": "the sweep runs no image through it, so its projector's cross-attention is not exercised",
    "transformers:audio-spectrogram-transformer":
        NO_INPUT
        + "IndexError: Dimension out of range (expected to be in range of [-3, 2], but got 3)",
    "transformers:autoformer": NO_BUILD + "ValueError: The `prediction_length` config needs to be specified.",
    "transformers:bailing_hybrid": OVER_CAP,
    "transformers:bark":
        NO_INPUT
        + "NotImplementedError: Module [BarkModel] is missing the required 'forward' function",
    "transformers:bit": NO_BUILD + "ValueError: num_channels (8) must be divisible by num_groups (32)",
    "transformers:blip": "the sweep runs no image-grounded text, so the text model's cross-attention is not exercised",
    "transformers:blip-2": NO_INPUT + "AttributeError: 'bool' object has no attribute 'unsqueeze'",
    "transformers:blip_2_qformer":
        NO_INPUT
        + "TypeError: Blip2QFormerModel.forward() missing 1 required positional argument: 'query_embeds'",
    "transformers:blt": OVER_CAP,
    "transformers:bridgetower":
        NO_BUILD
        + "ValueError: embed_dim and num_heads must be greater than 0, got embed_dim=32 and num_heads=0 "
        "instead",
    "transformers:bros": NO_INPUT + "ValueError: You have to specify bbox",
    "transformers:canary": NO_INPUT + "RuntimeError: mat1 and mat2 shapes cannot be multiplied (16x1024 and 4096x32)",
    "transformers:canine": NO_INPUT + "ValueError: You have to specify either input_ids or inputs_embeds",
    "transformers:chameleon": NO_BUILD + "AttributeError: 'NoneType' object has no attribute 'get'",
    "transformers:chmv2": NO_INPUT + "IndexError: list index out of range",
    "transformers:clap":
        NO_INPUT
        + "IndexError: Dimension out of range (expected to be in range of [-3, 2], but got 3)",
    "transformers:clvp":
        NO_INPUT
        + "TypeError: conv1d() received an invalid combination of arguments - got (NoneType, Parameter, "
        "Parameter, tuple, tuple, tuple, int), but expected one of:",
    "transformers:cohere_asr":
        NO_INPUT
        + "RuntimeError: mat1 and mat2 shapes cannot be multiplied (16x1024 and 4096x32)",
    "transformers:cohere_compass": NO_BUILD + "KeyError: 'full_attention'",
    "transformers:cohere_compass_text": NO_BUILD + "KeyError: 'full_attention'",
    "transformers:colmodernvbert":
        NO_INPUT
        + "TypeError: embedding(): argument 'indices' (position 2) must be Tensor, not NoneType",
    "transformers:colpali": NO_INPUT + "ValueError: You must specify exactly one of input_ids or inputs_embeds",
    "transformers:colqwen2":
        NO_INPUT
        + "TypeError: embedding(): argument 'indices' (position 2) must be Tensor, not NoneType",
    "transformers:csm": NO_BUILD + "ValueError: in_channels must be divisible by groups",
    "transformers:cvt": OVER_CAP,
    "transformers:d_fine":
        NO_INPUT
        + "RuntimeError: Given groups=1, weight of size [256, 32, 1, 1], expected input[1, 512, 4, 4] to "
        "have 32 channels, but got 512 channels instead",
    "transformers:dac":
        NO_INPUT
        + "RuntimeError: The size of tensor a (32) must match the size of tensor b (1600) at non-singleton "
        "dimension 1",
    "transformers:dbrx": NO_BUILD + "AttributeError: 'DbrxAttentionConfig' object has no attribute 'rope_theta'",
    "transformers:decision_transformer": NO_INPUT + "AttributeError: 'NoneType' object has no attribute 'shape'",
    "transformers:deepseek_ocr2": NO_BUILD + "TypeError: 'NoneType' object is not subscriptable",
    "transformers:deformable_detr":
        NO_INPUT
        + "ValueError: Expected more than 1 value per channel when training, got input size [1, 32, 1, 1]",
    "transformers:deimv2":
        NO_INPUT
        + "RuntimeError: Given groups=1, weight of size [256, 32, 1, 1], expected input[1, 512, 4, 4] to "
        "have 32 channels, but got 512 channels instead",
    "transformers:depth_anything": NO_INPUT + "TypeError: hidden_states should be a tuple or list of tensors",
    "transformers:depth_pro": NO_INPUT + "IndexError: tuple index out of range",
    "transformers:dia":
        NO_INPUT
        + "ValueError: You should either provide text ids or the cached text encodings. Neither has been "
        "found.",
    "transformers:diffusion_gemma":
        NO_BUILD
        + "TypeError: empty(): argument 'size' (position 1) must be tuple of ints, but found element of "
        "type NoneType at pos 0",
    "transformers:dinat": NO_BUILD + "ImportError: ",
    "transformers:dots1": NO_BUILD + "TypeError: empty() takes 1 positional argument but 3 were given",
    "transformers:edgetam":
        NO_INPUT
        + "RuntimeError: Given groups=1, weight of size [256, 384, 1, 1], expected input[1, 1024, 2, 2] to "
        "have 384 channels, but got 1024 channels instead",
    "transformers:edgetam_video":
        NO_INPUT
        + "TypeError: EdgeTamVideoModel.forward() missing 1 required positional argument: 'inference_session'",
    "transformers:edgetam_vision_model":
        NO_INPUT
        + "RuntimeError: Given groups=1, weight of size [256, 384, 1, 1], expected input[1, 1024, 2, 2] to "
        "have 384 channels, but got 1024 channels instead",
    "transformers:efficientloftr":
        NO_INPUT
        + "ValueError: Input must be a 5D tensor of shape (batch_size, 2, num_channels, height, width)",
    "transformers:efficientnet": NO_INPUT + "RuntimeError: running_mean should contain 2560 elements not 32",
    "transformers:emu3": NO_BUILD + "AttributeError: 'NoneType' object has no attribute 'get'",
    "transformers:encodec": NO_INPUT + "ValueError: not enough values to unpack (expected 3, got 2)",
    "transformers:encoder-decoder": NO_INPUT + "ValueError: You must specify exactly one of input_ids or inputs_embeds",
    "transformers:eomt":
        NO_INPUT
        + "RuntimeError: Given transposed=1, weight of size [32, 32, 2, 2], expected input[1, 0, 4, 4] to "
        "have 32 channels, but got 0 channels instead",
    "transformers:eomt_dinov3":
        NO_INPUT
        + "RuntimeError: Given transposed=1, weight of size [32, 32, 2, 2], expected input[1, 0, 4, 4] to "
        "have 32 channels, but got 0 channels instead",
    "transformers:ernie4_5_vl_moe": NO_INPUT + "AttributeError: 'NoneType' object has no attribute 'device'",
    "transformers:esm":
        NO_BUILD
        + "TypeError: empty(): argument 'size' (position 1) must be tuple of ints, but found element of "
        "type NoneType at pos 0",
    "transformers:evolla": "the sweep runs no protein input, so the sequence resampler's attention is not exercised",
    "transformers:falcon_h1":
        NO_INPUT
        + "RuntimeError: The size of tensor a (4) must match the size of tensor b (64) at non-singleton "
        "dimension 2",
    "transformers:fast_vlm": OVER_CAP,
    "transformers:fastspeech2_conformer_with_hifigan":
        NO_INPUT
        + "TypeError: FastSpeech2ConformerWithHifiGan.forward() missing 1 required positional argument: "
        "'input_ids'",
    "transformers:flava": "the sweep runs no joint image-text input, so the multimodal encoder is not exercised",
    "transformers:florence2": OVER_CAP,
    "transformers:fun_asr_nano":
        NO_INPUT
        + "RuntimeError: The size of tensor a (32) must match the size of tensor b (560) at non-singleton "
        "dimension 2",
    "transformers:fun_asr_nano_encoder":
        NO_INPUT
        + "RuntimeError: The size of tensor a (32) must match the size of tensor b (560) at non-singleton "
        "dimension 2",
    "transformers:gemma3n":
        NO_BUILD
        + "ValueError: The set of layer types producing a cache is different than the set of layer types "
        "using them",
    "transformers:gemma3n_audio":
        NO_INPUT
        + "TypeError: Gemma3nAudioEncoder.forward() missing 2 required positional arguments: 'audio_mel' "
        "and 'audio_mel_mask'",
    "transformers:gemma3n_text":
        NO_BUILD
        + "ValueError: The set of layer types producing a cache is different than the set of layer types "
        "using them",
    "transformers:gemma3n_vision": OVER_CAP,
    "transformers:gemma4_assistant":
        NO_BUILD
        + "StrictDataclassClassValidationError: Class validation error for validator 'validate_architecture':",
    "transformers:gemma4_audio":
        NO_INPUT
        + "RuntimeError: The size of tensor a (80) must match the size of tensor b (32) at non-singleton "
        "dimension 2",
    "transformers:gemma4_unified_assistant":
        NO_BUILD
        + "ValueError: The set of layer types producing a cache is different than the set of layer types "
        "using them",
    "transformers:gemma4_vision":
        NO_INPUT
        + "TypeError: Gemma4VisionModel.forward() missing 1 required positional argument: "
        "'pixel_position_ids'",
    "transformers:glm5_next": OVER_CAP,
    "transformers:glm5_next_text": OVER_CAP,
    "transformers:glm_image_vqmodel":
        NO_INPUT
        + "NotImplementedError: Module [GlmImageVQVAE] is missing the required 'forward' function",
    "transformers:granite4_vision": NO_BUILD + "TypeError: object of type 'NoneType' has no len()",
    "transformers:granite_speech":
        "the sweep runs no audio through it, so the speech encoder and its Q-Former are not exercised",
    "transformers:granite_speech5_ctc":
        NO_INPUT
        + "RuntimeError: mat1 and mat2 shapes cannot be multiplied (80x32 and 320x32)",
    "transformers:granite_speech5_encoder":
        NO_INPUT
        + "RuntimeError: mat1 and mat2 shapes cannot be multiplied (80x32 and 320x32)",
    "transformers:granite_speech_plus":
        "the sweep runs no audio through it, so the speech encoder and its Q-Former are not exercised",
    "transformers:grounding-dino":
        NO_INPUT
        + "ValueError: Expected more than 1 value per channel when training, got input size [1, 32, 1, 1]",
    "transformers:higgs_audio_v2_tokenizer": NO_BUILD + "ImportError: ",
    "transformers:hunyuan_v1_dense":
        NO_BUILD
        + "TypeError: unsupported operand type(s) for ** or pow(): 'NoneType' and 'float'",
    "transformers:hunyuan_v1_moe":
        NO_BUILD
        + "TypeError: unsupported operand type(s) for ** or pow(): 'NoneType' and 'float'",
    "transformers:hunyuan_vl":
        NO_BUILD
        + "TypeError: unsupported operand type(s) for ** or pow(): 'NoneType' and 'float'",
    "transformers:hunyuan_vl_text":
        NO_BUILD
        + "TypeError: unsupported operand type(s) for ** or pow(): 'NoneType' and 'float'",
    "transformers:idefics": NO_INPUT + "ValueError: not enough values to unpack (expected 4, got 3)",
    "transformers:idefics2": "the sweep runs no image through it, so the perceiver resampler is not exercised",
    "transformers:informer": NO_BUILD + "ValueError: The `prediction_length` config needs to be specified.",
    "transformers:inkling2": OVER_CAP,
    "transformers:inkling2_loop": OVER_CAP,
    "transformers:inkling2_loop_text": OVER_CAP,
    "transformers:inkling2_text": OVER_CAP,
    "transformers:inkling2_vision":
        NO_INPUT
        + "RuntimeError: shape '[-1, 2, 8, 2, 8, 192]' is invalid for input of size 3072",
    "transformers:inkling_mm_model": OVER_CAP,
    "transformers:inkling_text": OVER_CAP,
    "transformers:instructblip":
        NO_INPUT
        + "TypeError: InstructBlipModel.forward() missing 1 required positional argument: 'qformer_input_ids'",
    "transformers:instructblipvideo":
        NO_INPUT
        + "TypeError: InstructBlipVideoModel.forward() missing 1 required positional argument: "
        "'qformer_input_ids'",
    "transformers:janus":
        NO_INPUT
        + "ValueError: Expected `image_tokens` to have shape `(batch_size, 576)`, but got shape "
        "`torch.Size([1, 4])`.",
    "transformers:jev":
        NO_INPUT
        + "TypeError: JevForDecision.forward() missing 3 required positional arguments: 'marks', "
        "'num_options', and 'question_type_ids'",
    "transformers:kimi_k25_vision":
        NO_INPUT
        + "RuntimeError: Expected 3D (unbatched) or 4D (batched) input to conv2d, but got input of size: "
        "[4, 192]",
    "transformers:kosmos-2": NO_INPUT + "AttributeError: 'NoneType' object has no attribute 'to'",
    "transformers:kosmos-2.5":
        "the sweep runs no image through it, so the vision encoder and its cross-attention are not "
        "exercised",
    "transformers:kyutai_speech_to_text":
        NO_INPUT
        + "RuntimeError: The size of tensor a (6) must match the size of tensor b (33) at non-singleton "
        "dimension 1",
    "transformers:layoutlmv2": NO_BUILD + "ImportError: ",
    "transformers:layoutlmv3":
        NO_INPUT
        + "RuntimeError: The size of tensor a (32) must match the size of tensor b (768) at non-singleton "
        "dimension 2",
    "transformers:led":
        "sliding-window attention computed on chunked, strided views: the sweep does not intercept its q, "
        "k, v",
    "transformers:levit":
        NO_INPUT
        + "RuntimeError: The size of tensor a (4) must match the size of tensor b (16) at non-singleton "
        "dimension 3",
    "transformers:lfm2_moe": NO_BUILD + "TypeError: 'NoneType' object is not subscriptable",
    "transformers:lfm2_vl":
        NO_INPUT
        + "TypeError: Siglip2VisionModel.forward() missing 2 required positional arguments: "
        "'pixel_attention_mask' and 'spatial_shapes'",
    "transformers:lightglue":
        NO_INPUT
        + "ValueError: Input must be a 5D tensor of shape (batch_size, 2, num_channels, height, width)",
    "transformers:lilt": NO_INPUT + "RuntimeError: mat1 and mat2 shapes cannot be multiplied (6x30 and 32x8)",
    "transformers:llama4": NO_INPUT + "RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x128 and 48x4096)",
    "transformers:longformer":
        "sliding-window attention computed on chunked, strided views: the sweep does not intercept its q, "
        "k, v",
    "transformers:longt5": "local and transient-global attention over blocks: the sweep does not intercept its q, k, v",
    "transformers:lw_detr": NO_INPUT + "ValueError: torch.cat(): expected a non-empty list of Tensors",
    "transformers:lxmert": NO_INPUT + "ValueError: `visual_feats` cannot be `None`",
    "transformers:mamba2": NO_INPUT + "RuntimeError: repeat_interleave: Invalid output_size, expected 0 but got 4",
    "transformers:mask2former":
        "multi-scale deformable attention in its pixel decoder; its transformer decoder is not reached by "
        "the sweep's input",
    "transformers:mimi": NO_BUILD + "ValueError: in_channels must be divisible by groups",
    "transformers:mimi_decoder": NO_BUILD + "ValueError: in_channels must be divisible by groups",
    "transformers:mimi_encoder": NO_INPUT + "ValueError: not enough values to unpack (expected 3, got 2)",
    "transformers:minicpm_ocr": NO_INPUT + "AttributeError: 'NoneType' object has no attribute 'device'",
    "transformers:minicpm_ocr_vision": NO_INPUT + "AttributeError: 'NoneType' object has no attribute 'device'",
    "transformers:minicpmv4_6": NO_INPUT + "AttributeError: 'NoneType' object has no attribute 'device'",
    "transformers:minicpmv4_7": NO_INPUT + "AttributeError: 'NoneType' object has no attribute 'device'",
    "transformers:minicpmv4_7_vision": NO_INPUT + "AttributeError: 'NoneType' object has no attribute 'device'",
    "transformers:ministral":
        NO_BUILD
        + "TypeError: unsupported operand type(s) for ** or pow(): 'NoneType' and 'float'",
    "transformers:mllama":
        NO_INPUT
        + "TypeError: MllamaVisionModel.forward() missing 2 required positional arguments: "
        "'aspect_ratio_ids' and 'aspect_ratio_mask'",
    "transformers:mm-grounding-dino":
        NO_INPUT
        + "ValueError: Expected more than 1 value per channel when training, got input size [1, 32, 1, 1]",
    "transformers:mobilevit": "attention over unfolded patches: the sweep's reading finds no single query projection",
    "transformers:mobilevitv2":
        NO_INPUT
        + "RuntimeError: Given input with spatial size (1, 1), kernel_size=(2, 2), dilation=(1, 1), "
        "padding=(0, 0), calculated shape of the array of sliding blocks as (0, 0), but its components "
        "must be at least one.",
    "transformers:molmo2": NO_INPUT + "RuntimeError: mat1 and mat2 shapes cannot be multiplied (96x32 and 192x32)",
    "transformers:moonshine_streaming":
        NO_BUILD
        + "AttributeError: 'MoonshineStreamingConfig' object has no attribute 'num_key_value_heads'",
    "transformers:moss_transcribe_diarize":
        NO_INPUT
        + "RuntimeError: Expected attn_mask dtype to be bool or float or to match query dtype, but got "
        "attn_mask.dtype: long int and  query.dtype: float instead.",
    "transformers:moss_transcribe_diarize_audio":
        NO_INPUT
        + "RuntimeError: Expected attn_mask dtype to be bool or float or to match query dtype, but got "
        "attn_mask.dtype: long int and  query.dtype: float instead.",
    "transformers:muse_glimmer":
        NO_INPUT
        + "RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x192 and 384x32)",
    "transformers:muse_glimmer_assistant":
        NO_INPUT
        + "TypeError: MuseGlimmerAssistantModel.forward() missing 2 required positional arguments: "
        "'noise_embeds' and 'context_hidden_states'",
    "transformers:muse_glimmer_vision":
        NO_INPUT
        + "RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x192 and 384x32)",
    "transformers:muse_spark": NO_INPUT + "RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x192 and 384x32)",
    "transformers:muse_spark_audio":
        NO_INPUT
        + "ValueError: `input_values` length 1600 is not a multiple of 1920. Prepare the audio with "
        "`MuseSparkFeatureExtractor`, which pads up to a multiple of it.",
    "transformers:muse_spark_vision":
        NO_INPUT
        + "RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x192 and 384x32)",
    "transformers:musicgen": NO_BUILD + "AttributeError: 'MusicgenConfig' object has no attribute 'dropout'",
    "transformers:musicgen_melody":
        NO_BUILD
        + "AttributeError: 'MusicgenMelodyConfig' object has no attribute 'dropout'",
    "transformers:nemo_speechlm":
        NO_INPUT
        + "RuntimeError: The size of tensor a (32) must match the size of tensor b (128) at non-singleton "
        "dimension 1",
    "transformers:nemotron": NO_BUILD + "TypeError: unsupported operand type(s) for //: 'int' and 'NoneType'",
    "transformers:nemotron3_5_asr":
        NO_INPUT
        + "RuntimeError: mat1 and mat2 shapes cannot be multiplied (11x1280 and 2816x32)",
    "transformers:nemotron3_5_transcribe_audio":
        NO_INPUT
        + "RuntimeError: The size of tensor a (32) must match the size of tensor b (128) at non-singleton "
        "dimension 1",
    "transformers:nemotron3_5_transcribe_word_timestamp":
        NO_INPUT
        + "TypeError: Nemotron3_5TranscribeWordTimestampModel.forward() missing 1 required positional "
        "argument: 'inputs_embeds'",
    "transformers:nemotron3_diarization":
        NO_INPUT
        + "RuntimeError: mat1 and mat2 shapes cannot be multiplied (16x256 and 1024x32)",
    "transformers:nemotron_asr_streaming":
        NO_INPUT
        + "RuntimeError: mat1 and mat2 shapes cannot be multiplied (11x1280 and 2816x32)",
    "transformers:nemotron_asr_streaming_encoder":
        NO_INPUT
        + "RuntimeError: mat1 and mat2 shapes cannot be multiplied (11x1280 and 2816x32)",
    "transformers:nemotron_h_omni":
        NO_INPUT
        + "RuntimeError: mat1 and mat2 shapes cannot be multiplied (16x192 and 768x32)",
    "transformers:neucodec":
        NO_INPUT
        + "TypeError: NeuCodecModel.forward() missing 1 required positional argument: 'input_features'",
    "transformers:omdet-turbo":
        NO_INPUT
        + "TypeError: OmDetTurboForObjectDetection.forward() missing 5 required positional arguments: "
        "'classes_input_ids', 'classes_attention_mask', 'tasks_input_ids', 'tasks_attention_mask', and "
        "'classes_structure'",
    "transformers:omniasr":
        NO_INPUT
        + "IndexError: Dimension out of range (expected to be in range of [-2, 1], but got 2)",
    "transformers:omniasr_audio":
        NO_INPUT
        + "IndexError: Dimension out of range (expected to be in range of [-2, 1], but got 2)",
    "transformers:omniasr_ctc":
        NO_INPUT
        + "IndexError: Dimension out of range (expected to be in range of [-2, 1], but got 2)",
    "transformers:oneformer":
        NO_INPUT
        + "TypeError: OneFormerModel.forward() missing 1 required positional argument: 'task_inputs'",
    "transformers:paddleocr_vl": NO_INPUT + "AttributeError: 'NoneType' object has no attribute 'device'",
    "transformers:parakeet_ctc":
        NO_INPUT
        + "RuntimeError: mat1 and mat2 shapes cannot be multiplied (10x1024 and 2560x32)",
    "transformers:parakeet_encoder":
        NO_INPUT
        + "RuntimeError: mat1 and mat2 shapes cannot be multiplied (10x1024 and 2560x32)",
    "transformers:parakeet_rnnt":
        NO_INPUT
        + "RuntimeError: mat1 and mat2 shapes cannot be multiplied (10x1024 and 2560x32)",
    "transformers:parakeet_tdt":
        NO_INPUT
        + "RuntimeError: mat1 and mat2 shapes cannot be multiplied (10x1024 and 2560x32)",
    "transformers:pe_audio":
        NO_INPUT
        + "RuntimeError: The size of tensor a (32) must match the size of tensor b (1600) at non-singleton "
        "dimension 1",
    "transformers:pe_audio_encoder":
        NO_INPUT
        + "RuntimeError: The size of tensor a (32) must match the size of tensor b (1600) at non-singleton "
        "dimension 1",
    "transformers:pe_audio_video":
        NO_INPUT
        + "RuntimeError: The size of tensor a (32) must match the size of tensor b (1600) at non-singleton "
        "dimension 1",
    "transformers:pe_audio_video_encoder":
        NO_INPUT
        + "RuntimeError: The size of tensor a (32) must match the size of tensor b (1600) at non-singleton "
        "dimension 1",
    "transformers:pe_video":
        NO_INPUT
        + "TypeError: PeVideoModel.forward() missing 1 required positional argument: 'pixel_values_videos'",
    "transformers:pe_video_encoder": NO_INPUT + "AssertionError: Input height (32) doesn't match model (336).",
    "transformers:perceiver":
        NO_INPUT
        + "TypeError: PerceiverModel.forward() missing 1 required positional argument: 'inputs'",
    "transformers:perception_lm": NO_BUILD + "TypeError: 'NoneType' object is not subscriptable",
    "transformers:phi4_multimodal":
        NO_INPUT
        + "TypeError: Phi4MultimodalImageEmbedding.forward() missing 2 required positional arguments: "
        "'inputs_embeds' and 'image_pixel_values'",
    "transformers:pi0":
        NO_INPUT
        + "TypeError: PI0Model.forward() missing 1 required positional argument: 'action_embeds'",
    "transformers:pi05":
        NO_INPUT
        + "TypeError: PI05Model.forward() missing 1 required positional argument: 'action_embeds'",
    "transformers:pix2struct": NO_INPUT + "ValueError: You have to specify flattened_patches",
    "transformers:pocket_tts_audio_tokenizer": NO_BUILD + "ValueError: in_channels must be divisible by groups",
    "transformers:pocket_tts_audio_tokenizer_decoder": NO_BUILD + "ValueError: in_channels must be divisible by groups",
    "transformers:pocket_tts_audio_tokenizer_encoder":
        NO_INPUT
        + "ValueError: not enough values to unpack (expected 3, got 2)",
    "transformers:pp_doclayout_v2":
        NO_INPUT
        + "RuntimeError: Given groups=1, weight of size [256, 32, 1, 1], expected input[1, 512, 4, 4] to "
        "have 32 channels, but got 512 channels instead",
    "transformers:pp_doclayout_v3":
        NO_INPUT
        + "RuntimeError: Given groups=1, weight of size [256, 32, 1, 1], expected input[1, 512, 4, 4] to "
        "have 32 channels, but got 512 channels instead",
    "transformers:pp_doclayout_v4":
        NO_INPUT
        + "RuntimeError: Given groups=1, weight of size [256, 32, 1, 1], expected input[1, 512, 4, 4] to "
        "have 32 channels, but got 512 channels instead",
    "transformers:pp_ocrv5_mobile_rec":
        NO_INPUT
        + "RuntimeError: Given input size: (384x1x1). Calculated output size: (384x0x0). Output size is too "
        "small",
    "transformers:pp_ocrv5_server_det": NO_BUILD + "TypeError: 'NoneType' object is not subscriptable",
    "transformers:pp_ocrv5_server_rec":
        NO_INPUT
        + "RuntimeError: Given input size: (2048x2x8). Calculated output size: (2048x0x4). Output size is "
        "too small",
    "transformers:pp_ocrv6_medium_det": NO_BUILD + "TypeError: 'NoneType' object is not subscriptable",
    "transformers:pp_ocrv6_small_det":
        NO_INPUT
        + "RuntimeError: Given groups=1, weight of size [96, 12, 1, 1], expected input[1, 384, 2, 8] to "
        "have 12 channels, but got 384 channels instead",
    "transformers:pp_ocrv6_small_rec":
        NO_INPUT
        + "RuntimeError: Given input size: (384x2x8). Calculated output size: (384x0x4). Output size is too "
        "small",
    "transformers:pp_ocrv6_tiny_rec":
        NO_INPUT
        + "RuntimeError: Given input size: (384x2x8). Calculated output size: (384x0x4). Output size is too "
        "small",
    "transformers:prompt_depth_anything": NO_INPUT + "TypeError: hidden_states should be a tuple or list of tensors",
    "transformers:qwen2_5_omni":
        NO_INPUT
        + "NotImplementedError: Module [Qwen2_5OmniForConditionalGeneration] is missing the required "
        "'forward' function",
    "transformers:qwen2_5_omni_thinker":
        NO_INPUT
        + "TypeError: unsupported operand type(s) for /: 'NoneType' and 'int'",
    "transformers:qwen2_audio":
        NO_INPUT
        + "RuntimeError: Expected attn_mask dtype to be bool or float or to match query dtype, but got "
        "attn_mask.dtype: long int and  query.dtype: float instead.",
    "transformers:qwen2_audio_encoder":
        NO_INPUT
        + "RuntimeError: Expected attn_mask dtype to be bool or float or to match query dtype, but got "
        "attn_mask.dtype: long int and  query.dtype: float instead.",
    "transformers:qwen3_asr":
        NO_INPUT
        + "ValueError: Qwen3ASREncoder expects `padded_feature_length` to be a multiple of `n_window * 2` "
        "(100), but got 32.",
    "transformers:qwen3_asr_encoder":
        NO_INPUT
        + "ValueError: Qwen3ASREncoder expects `padded_feature_length` to be a multiple of `n_window * 2` "
        "(100), but got 32.",
    "transformers:qwen3_omni_moe":
        NO_BUILD
        + "AttributeError: 'Qwen3OmniMoeTalkerTextConfig' object has no attribute "
        "'shared_expert_intermediate_size'",
    "transformers:qwen3_omni_moe_thinker":
        NO_INPUT
        + "TypeError: unsupported operand type(s) for /: 'NoneType' and 'int'",
    "transformers:qwen4_exp": NO_BUILD + "TypeError: unsupported operand type(s) for //: 'NoneType' and 'NoneType'",
    "transformers:qwen4_exp_text":
        NO_BUILD
        + "TypeError: unsupported operand type(s) for //: 'NoneType' and 'NoneType'",
    "transformers:radio": NO_INPUT + "RuntimeError: mat1 and mat2 shapes cannot be multiplied (16x192 and 768x32)",
    "transformers:recurrent_gemma": DROPS_ATTENTION + "(['RecurrentGemmaAttention'])",
    "transformers:reformer":
        NO_BUILD
        + "ValueError: Make sure that config.axial_pos_embds factors: (64, 192) sum to config.hidden_size: 32",
    "transformers:rf_detr":
        NO_INPUT
        + "TypeError: cat(): argument 'tensors' (position 1) must be tuple of Tensors, not NoneType",
    "transformers:rt_detr": NO_INPUT + "RuntimeError: selected index k out of range",
    "transformers:rt_detr_v2": NO_INPUT + "RuntimeError: selected index k out of range",
    "transformers:rwkv": NO_BUILD + "ZeroDivisionError: division by zero",
    "transformers:sam":
        NO_INPUT
        + "RuntimeError: The size of tensor a (4) must match the size of tensor b (64) at non-singleton "
        "dimension 3",
    "transformers:sam2":
        NO_INPUT
        + "RuntimeError: Given normalized_shape=[96], expected input with shape [*, 96], but got input of "
        "size[1, 8, 8, 32]",
    "transformers:sam2_hiera_det_model":
        NO_INPUT
        + "RuntimeError: Given normalized_shape=[96], expected input with shape [*, 96], but got input of "
        "size[1, 8, 8, 32]",
    "transformers:sam2_video":
        NO_INPUT
        + "TypeError: Sam2VideoModel.forward() missing 1 required positional argument: 'inference_session'",
    "transformers:sam2_vision_model":
        NO_INPUT
        + "RuntimeError: Given normalized_shape=[96], expected input with shape [*, 96], but got input of "
        "size[1, 8, 8, 32]",
    "transformers:sam3":
        NO_INPUT
        + "RuntimeError: Given normalized_shape=[32], expected input with shape [*, 32], but got input of "
        "size[1, 16, 256]",
    "transformers:sam3_lite_text":
        NO_INPUT
        + "RuntimeError: Given normalized_shape=[32], expected input with shape [*, 32], but got input of "
        "size[1, 16, 256]",
    "transformers:sam3_lite_text_text_model": DROPS_ATTENTION + "(['Sam3LiteTextTextAttention'])",
    "transformers:sam3_tracker":
        NO_INPUT
        + "RuntimeError: Given groups=1, weight of size [4, 32, 1, 1], expected input[1, 256, 16, 16] to "
        "have 32 channels, but got 256 channels instead",
    "transformers:sam3_tracker_video":
        NO_INPUT
        + "TypeError: Sam3TrackerVideoModel.forward() missing 1 required positional argument: "
        "'inference_session'",
    "transformers:sam3_video":
        NO_INPUT
        + "TypeError: Sam3VideoModel.forward() missing 1 required positional argument: 'inference_session'",
    "transformers:sam_hq":
        NO_INPUT
        + "RuntimeError: Given transposed=1, weight of size [32, 8, 2, 2], expected input[1, 256, 4, 4] to "
        "have 32 channels, but got 256 channels instead",
    "transformers:sapiens2":
        NO_INPUT
        + "RuntimeError: The size of tensor a (2) must match the size of tensor b (16) at non-singleton "
        "dimension 1",
    "transformers:seamless_m4t":
        NO_INPUT
        + "RuntimeError: Given normalized_shape=[160], expected input with shape [*, 160], but got input of "
        "size[1, 80, 32]",
    "transformers:seamless_m4t_v2":
        NO_INPUT
        + "RuntimeError: Given normalized_shape=[160], expected input with shape [*, 160], but got input of "
        "size[1, 80, 32]",
    "transformers:seggpt":
        NO_INPUT
        + "TypeError: SegGptModel.forward() missing 2 required positional arguments: 'prompt_pixel_values' "
        "and 'prompt_masks'",
    "transformers:shieldgemma2": NO_INPUT + "RuntimeError: stride should not be zero",
    "transformers:siglip": NO_INPUT + "RuntimeError: mat1 and mat2 shapes cannot be multiplied (1x768 and 32x1)",
    "transformers:siglip2": NO_INPUT + "RuntimeError: mat1 and mat2 shapes cannot be multiplied (96x32 and 192x32)",
    "transformers:siglip2_vision_model":
        NO_INPUT
        + "TypeError: Siglip2VisionModel.forward() missing 2 required positional arguments: "
        "'pixel_attention_mask' and 'spatial_shapes'",
    "transformers:speech-encoder-decoder":
        NO_INPUT
        + "ValueError: You have to specify either input_values or input_features",
    "transformers:speecht5":
        NO_INPUT
        + "RuntimeError: Given normalized_shape=[32], expected input with shape [*, 32], but got input of "
        "size[1, 1600]",
    "transformers:step3p7":
        NO_INPUT
        + "ValueError: Image features and image tokens do not match, tokens: 0, features: 1",
    "transformers:superglue":
        NO_INPUT
        + "ValueError: Input must be a 5D tensor of shape (batch_size, 2, num_channels, height, width)",
    "transformers:switch_transformers":
        "re-running its decoder attention on the captured inputs fails (relative position bias shape)",
    "transformers:t5gemma": NO_INPUT + "RuntimeError: mat1 and mat2 shapes cannot be multiplied (6x32 and 2304x16)",
    "transformers:t5gemma2_encoder":
        NO_BUILD
        + "AttributeError: 'T5Gemma2TextConfig' object has no attribute 'dropout_rate'",
    "transformers:textnet":
        NO_INPUT
        + "RuntimeError: Given groups=1, weight of size [32, 32, 3, 3], expected input[1, 64, 16, 16] to "
        "have 32 channels, but got 64 channels instead",
    "transformers:time_series_transformer":
        NO_BUILD
        + "ValueError: The `prediction_length` config needs to be specified.",
    "transformers:timesfm":
        NO_INPUT
        + "TypeError: TimesFmModel.forward() missing 2 required positional arguments: 'past_values_padding' "
        "and 'freq'",
    "transformers:timesfm2_5": NO_INPUT + "ValueError: too many values to unpack (expected 2)",
    "transformers:timm_backbone":
        NO_BUILD
        + "ValueError: backbone is not set in the config. Please set it to a timm model name.",
    "transformers:tipsv2_dpt": NO_INPUT + "TypeError: hidden_states should be a tuple or list of tensors",
    "transformers:trocr": "a decoder whose cross-attention needs encoder states, which the sweep does not provide",
    "transformers:tvp": NO_INPUT + "AttributeError: 'NoneType' object has no attribute 'dtype'",
    "transformers:udop": NO_INPUT + "ValueError: Bbox is required for horizontal relative position bias",
    "transformers:unlimited_ocr":
        NO_INPUT
        + "RuntimeError: Sizes of tensors must match except in dimension 1. Expected size 32 but got size "
        "1024 for tensor number 1 in the list.",
    "transformers:uvdoc":
        NO_INPUT
        + "RuntimeError: Given groups=1, weight of size [128, 768, 1, 1], expected input[1, 128, 2, 2] to "
        "have 768 channels, but got 128 channels instead",
    "transformers:vibevoice":
        NO_INPUT
        + "IndexError: Dimension out of range (expected to be in range of [-2, 1], but got 2)",
    "transformers:vibevoice_acoustic_tokenizer":
        NO_INPUT
        + "IndexError: Dimension out of range (expected to be in range of [-2, 1], but got 2)",
    "transformers:vibevoice_acoustic_tokenizer_decoder":
        NO_INPUT
        + "TypeError: VibeVoiceAcousticTokenizerDecoderModel.forward() missing 1 required positional "
        "argument: 'hidden_states'",
    "transformers:vibevoice_acoustic_tokenizer_encoder":
        NO_INPUT
        + "TypeError: VibeVoiceAcousticTokenizerEncoderModel.forward() missing 1 required positional "
        "argument: 'hidden_states'",
    "transformers:video_llama_3":
        NO_INPUT
        + "TypeError: VideoLlama3VisionModel.forward() missing 1 required positional argument: 'merge_sizes'",
    "transformers:video_llama_3_vision":
        NO_INPUT
        + "TypeError: VideoLlama3VisionModel.forward() missing 1 required positional argument: 'merge_sizes'",
    "transformers:vilt": NO_INPUT + "ValueError: You have to specify either pixel_values or image_embeds",
    "transformers:vision-text-dual-encoder":
        NO_INPUT
        + "RuntimeError: mat1 and mat2 shapes cannot be multiplied (1x768 and 32x32)",
    "transformers:vitmatte": NO_BUILD + "TypeError: can only concatenate list (not 'tuple') to list",
    "transformers:vitpose":
        NO_BUILD
        + "RuntimeError: Trying to create tensor with negative dimension -224: [-224, 128]",
    "transformers:vitpose_backbone":
        NO_BUILD
        + "RuntimeError: Trying to create tensor with negative dimension -224: [-224, 128]",
    "transformers:vjepa2": OVER_CAP,
    "transformers:voxtral":
        NO_INPUT
        + "RuntimeError: Expected attn_mask dtype to be bool or float or to match query dtype, but got "
        "attn_mask.dtype: long int and  query.dtype: float instead.",
    "transformers:voxtral_encoder":
        NO_INPUT
        + "RuntimeError: Expected attn_mask dtype to be bool or float or to match query dtype, but got "
        "attn_mask.dtype: long int and  query.dtype: float instead.",
    "transformers:voxtral_realtime":
        NO_INPUT
        + "RuntimeError: The size of tensor a (6) must match the size of tensor b (4) at non-singleton "
        "dimension 1",
    "transformers:voxtral_realtime_encoder":
        NO_INPUT
        + "RuntimeError: The size of tensor a (16) must match the size of tensor b (32) at non-singleton "
        "dimension 3",
    "transformers:voxtral_realtime_text":
        NO_BUILD
        + "AttributeError: module transformers has no attribute VoxtralRealtimeTextModel",
    "transformers:wav2vec2-bert":
        NO_INPUT
        + "RuntimeError: Given normalized_shape=[160], expected input with shape [*, 160], but got input of "
        "size[1, 80, 32]",
    "transformers:wavtokenizer":
        NO_BUILD
        + "StrictDataclassClassValidationError: Class validation error for validator 'validate_architecture':",
    "transformers:wavtokenizer_encoder":
        NO_INPUT
        + "RuntimeError: permute(sparse_coo): number of dimensions in the tensor input does not match the "
        "length of the desired ordering of dimensions i.e. input.dim() = 2 is not equal to len(dims) = 3",
    "transformers:xclip":
        NO_INPUT
        + "RuntimeError: The size of tensor a (32) must match the size of tensor b (512) at non-singleton "
        "dimension 2",
    "transformers:xcodec": NO_INPUT + "ValueError: Audio must be mono, but got 1600",
    "transformers:xcodec2":
        NO_INPUT
        + "TypeError: Xcodec2Model.forward() missing 1 required positional argument: 'input_features'",
    "transformers:xlstm":
        NO_INPUT
        + "RuntimeError: The size of tensor a (4096) must match the size of tensor b (32) at non-singleton "
        "dimension 2",
    "transformers:xmod":
        NO_INPUT
        + "ValueError: Input language unknown. Please call `XmodPreTrainedModel.set_default_language()`",
    "transformers:zamba":
        NO_INPUT
        + "RuntimeError: The size of tensor a (7424) must match the size of tensor b (64) at non-singleton "
        "dimension 2",
    "transformers:zamba2": NO_INPUT + "RuntimeError: shape '[1, 6, 8, 640]' is invalid for input of size 384",
    "transformers:zoedepth": NO_INPUT + "TypeError: hidden_states should be a tuple or list of tensors",
}

# Always in the sample (CONDINIT_COVERAGE=sample): the families most models are built from.
MAIN_FAMILIES = tuple(f"transformers:{t}" for t in (
    "llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text", "phi", "phi3",
    "olmo2", "cohere", "starcoder2", "gpt2", "gpt_bigcode", "gpt_neox", "gptj", "falcon", "bloom", "mpt", "opt",
    "bert", "roberta", "deberta-v2", "electra", "albert", "distilbert", "t5", "bart", "mbart", "whisper", "wav2vec2",
    "clip", "siglip", "vit", "deit", "beit", "swin", "dinov2", "llava", "qwen2_vl", "detr", "mamba",
)) + tuple(f"timm:{t}" for t in ("vit", "vit (global_pool='map')", "deit (distilled)", "swin", "eva02", "beit")) + \
    tuple(f"torch.nn:{t}" for t in ("MultiheadAttention", "MultiheadAttention (kdim, vdim)", "TransformerEncoderLayer",
                                    "TransformerDecoderLayer", "Transformer"))
SAMPLE_STRIDE = 4


def apply_condinit(model):
    return condinit.apply(model, seed=0)


@functools.lru_cache(maxsize=1)
def _archs():
    return {a.name: a for a in architectures()}


def _arch_ids():
    names = [n for n in _archs() if n not in REFUSED and n not in NOT_CHECKED]
    if os.environ.get("CONDINIT_COVERAGE", "all") != "sample":
        return names
    main = [n for n in MAIN_FAMILIES if n in names]
    return main + [n for n in names[::SAMPLE_STRIDE] if n not in main]


# In the fast tier (``-m "not slow"``): one model of each layout kind; the rest of the sweep is slow.
FAST_FAMILIES = ("transformers:llama", "transformers:gpt2", "transformers:gpt_neox", "transformers:falcon",
                 "transformers:bert", "transformers:t5", "transformers:whisper", "transformers:vit", "timm:vit",
                 "torch.nn:MultiheadAttention")


def _arch_params():
    return [n if n in FAST_FAMILIES else pytest.param(n, marks=pytest.mark.slow) for n in _arch_ids()]


# Architectures conditioned where the method applies, with some attention-like layers outside it:
# those are refused and reported (an UncoveredAttentionWarning naming their class), never skipped
# silently. The sweep's reading does not look for attention without a softmax, so the check of
# the layers it reads is the same as for every other architecture.
PARTLY_REFUSED = {
    "transformers:minimax": ("MiniMaxLightningAttention",
                             "its lightning attention layers are linear attention (no softmax over the keys): "
                             "refused and reported"),
}


@pytest.mark.parametrize("name", _arch_params())
def test_architecture(name):
    import warnings

    from condinit.models.apply import UncoveredAttentionWarning
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", UncoveredAttentionWarning)
        out = verify(_archs()[name], apply_condinit)
    assert out.status in ("conditioned", "no attention"), f"{name}: " + "\n  ".join(out.details)
    if name in PARTLY_REFUSED:
        cls = PARTLY_REFUSED[name][0]
        assert any(issubclass(w.category, UncoveredAttentionWarning) and cls in str(w.message) for w in seen), \
            f"{name}: its {cls} layers were not reported"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(n for n, why in REFUSED.items() if why == MLA_FACTORS))
def test_latent_attention_by_factors(name):
    """The sweep's model of each architecture whose latent attention is conditioned by factors:
    ``condinit.apply(mla="factors")``, then every layer's per-head maps read from its forward
    (``coverage_models.latent_maps``), every parameter but the factors and their biases unchanged."""
    from coverage_models import latent_maps, latent_problems

    model = build_hf(name.split(":", 1)[1]).double()
    factors = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj")
    attns = [m for m in model.modules() if hasattr(m, "kv_b_proj")]
    written = {id(p) for a in attns for n in factors if getattr(a, n, None) is not None
               for p in getattr(a, n).parameters()}
    before = {n: p.detach().clone() for n, p in model.named_parameters() if id(p) not in written}
    condinit.apply(model, seed=0, mla="factors", strict=True)
    assert attns and all(torch.equal(p, before[n]) for n, p in model.named_parameters() if n in before)
    rotary = next(m for n, m in model.named_modules() if n.endswith("rotary_emb"))
    x = torch.zeros(1, 1, model.config.hidden_size, dtype=torch.float64)
    pos = rotary(x, torch.tensor([[3]]))
    pos = pos if isinstance(pos, torch.Tensor) else tuple(p.double() for p in pos)
    for a in attns:
        problems = latent_problems(latent_maps(a, pos, model.config.hidden_size), nope_dim=a.qk_nope_head_dim,
                                   kv_rank=a.kv_lora_rank)
        assert not problems, problems


def test_lists_name_real_architectures_with_reasons():
    partly = {n: why for n, (_, why) in PARTLY_REFUSED.items()}
    for listed in (REFUSED, NOT_CHECKED, partly):
        unknown = sorted(set(listed) - set(_archs()))
        assert not unknown, f"listed architectures the sweep does not have: {unknown}"
        assert all(isinstance(r, str) and len(r) > 10 for r in listed.values())
    assert not set(REFUSED) & set(NOT_CHECKED) and not set(PARTLY_REFUSED) & (set(REFUSED) | set(NOT_CHECKED))
    missing = [n for n in MAIN_FAMILIES if n not in _archs()]
    assert not missing, f"main families the installed libraries do not have: {missing}"


# ------------------------------------------------------------------------------------------------
# the reading itself, on layouts known by hand (it must not depend on condinit to be right)

def _read(model_type):
    model = build_hf(model_type)
    errors = []
    reading = read_model(model, lambda m: errors.extend(hf_run(m)))
    assert not errors and not reading.problems(), errors + reading.problems()
    return model, reading


def test_reading_finds_gpt2_fused_transposed_layout():
    model, reading = _read("gpt2")
    [r] = reading.attention
    E, d = model.config.n_embd, model.config.n_embd // model.config.n_head
    assert (r.q.weight, r.k.weight, r.v.weight) == ("h.0.attn.c_attn.weight",) * 3
    assert r.q.transposed and r.k.transposed and r.v.transposed          # Conv1D: [in, out]
    assert r.q.heads == [list(range(h * d, (h + 1) * d)) for h in range(model.config.n_head)]
    assert r.k.rows == list(range(E, 2 * E)) and r.v.rows == list(range(2 * E, 3 * E))
    assert [b for b, _ in r.q.biases] == ["h.0.attn.c_attn.bias"]


def test_reading_finds_gpt_neox_interleaved_heads():
    model, reading = _read("gpt_neox")
    [r] = reading.attention
    H = model.config.num_attention_heads
    d = model.config.hidden_size // H
    # query_key_value rows are [head 0: q k v | head 1: q k v | ...]
    assert r.q.heads == [list(range(3 * d * h, 3 * d * h + d)) for h in range(H)]
    assert r.k.heads == [list(range(3 * d * h + d, 3 * d * h + 2 * d)) for h in range(H)]
    assert r.v.heads == [list(range(3 * d * h + 2 * d, 3 * d * h + 3 * d)) for h in range(H)]
    assert not r.q.transposed


def test_reading_finds_grouped_kv_heads_and_mha_in_proj():
    model, reading = _read("llama")
    [r] = reading.attention
    cfg = model.config
    assert len(r.q.heads) == cfg.num_attention_heads and len(r.k.heads) == cfg.num_key_value_heads
    mha = torch.nn.MultiheadAttention(24, 3, batch_first=True)
    x = torch.randn(1, 5, 24)
    [m] = read_model(mha, lambda m: m(x, x, x)).attention
    assert m.q.weight == m.k.weight == m.v.weight == "in_proj_weight"
    assert (m.q.rows, m.k.rows, m.v.rows) == (list(range(24)), list(range(24, 48)), list(range(48, 72)))
    assert len(m.q.heads) == 3


def test_reading_of_3d_and_expert_stacked_weights():
    model, reading = _read("xlnet")
    [r] = reading.attention
    H, d = model.config.n_head, model.config.d_head
    # [D, H, d] read as [D, H*d] (transposed): H distinct heads, not one head of d rows repeated
    assert (r.q.weight, r.q.split, r.q.transposed) == ("layer.0.rel_attn.q", 1, True)
    assert r.q.heads == [list(range(h * d, (h + 1) * d)) for h in range(H)]
    model, reading = _read("jetmoe")
    [r] = reading.attention
    cfg = model.config
    E, Hkv, d = cfg.num_local_experts, cfg.num_key_value_heads, cfg.kv_channels
    # the query experts a token is routed to differ by token: every expert's heads are read
    assert r.q.weight.endswith("experts.input_linear.weight") and r.q.split == 2
    assert sorted(sorted(h) for h in r.q.heads) == [list(range(j * d, (j + 1) * d)) for j in range(E * Hkv)]


# ------------------------------------------------------------------------------------------------
# negative controls: the check must fail where the method was not applied

def test_check_fails_on_default_init():
    for model_type in ("llama", "gpt2", "gpt_neox"):
        model, reading = _read(model_type)
        failures = check_conditioned(model, reading, state_snapshot(model))
        assert any(" Q head " in f for f in failures), (model_type, failures)
        assert any(" K head " in f for f in failures), (model_type, failures)
        assert any(": V " in f for f in failures), (model_type, failures)


def test_check_fails_after_one_change_to_a_conditioned_model():
    model, reading = _read("bert")
    before = state_snapshot(model)
    apply_condinit(model)
    assert check_conditioned(model, reading, before) == []
    conditioned = state_snapshot(model)
    [r] = reading.attention
    params = dict(model.named_parameters())

    def fails_after(name, index, what):
        with torch.no_grad():
            params[name][index] += 1e-3
        failures = check_conditioned(model, reading, before)
        with torch.no_grad():
            params[name].copy_(conditioned[name])
        assert any(what in f for f in failures), (name, failures)

    q_row = r.q.heads[1][0]
    fails_after(r.q.weight, (q_row, 0), " Q head 1 ")
    fails_after(r.k.weight, (r.k.heads[0][3], 5), " K head 0 ")
    fails_after(r.v.weight, (r.v.heads[1][2], 7), ": V ")
    fails_after(r.q.biases[0][0], r.q.biases[0][1][0], " Q bias ")
    mlp = next(n for n in params if "intermediate" in n and n.endswith("weight"))
    fails_after(mlp, (0, 0), f"{mlp}: changed")
    assert check_conditioned(model, reading, before) == []


def test_check_reads_grouped_convolutions_block_diagonally():
    model, reading = _read("squeezebert")
    before = state_snapshot(model)
    apply_condinit(model)
    assert check_conditioned(model, reading, before) == []
    # V written as the identity of the stored [C, C / groups] matrix: only the first group's block
    # of the convolution's block-diagonal matrix is the identity, the others are zero
    value = model.encoder.layers[0].attention.value
    with torch.no_grad():
        value.weight[:, :, 0] = torch.eye(*value.weight.shape[:2])
    assert any(": V " in f for f in check_conditioned(model, reading, before))


def test_check_fails_when_only_the_routed_query_experts_are_conditioned():
    from condinit.models import AttentionSpec, Projection, register_adapter, unregister_adapter

    model, reading = _read("jetmoe")
    attn = model.layers[0].self_attention
    cls = type(attn)
    Hkv, d = attn.num_key_value_heads, attn.head_dim
    w = attn.experts.input_linear.weight

    def first_expert_only(m):     # Q: expert 0's heads only, as if the others did not exist
        kv = m.kv_proj.weight
        return AttentionSpec(Projection(w, 0, Hkv * d, matrix_shape=(w.shape[0] * w.shape[1], w.shape[2])),
                             Projection(kv, 0, Hkv * d), Projection(kv, Hkv * d, 2 * Hkv * d), Hkv, Hkv, d)

    before = state_snapshot(model)
    register_adapter(cls, first_expert_only)
    try:
        apply_condinit(model)
    finally:
        unregister_adapter(cls)
    assert any(" Q head " in f for f in check_conditioned(model, reading, before))
