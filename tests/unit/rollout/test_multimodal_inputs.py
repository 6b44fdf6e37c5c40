"""Miles's ``Sample.multimodal_inputs`` (radixark/miles@v0.1.0:miles/utils/types.py; its multi-turn geo3k example
reads it and extends its images with each observation's): ``{"images": [PIL images], "videos": None}`` of the
sample's images, loaded from the references ``--multimodal-keys`` puts in ``metadata["multimodal_inputs"]``; what a
plugin assigns or appends is written back as references before the sample's next request and when its generate
function returns (and at the wire), so the engine's ``image_data`` and the images each trainer rank recomputes are
exactly the ones the plugin left."""

from __future__ import annotations

import asyncio
import base64
import inspect
import io

import numpy as np
import pytest
from PIL import Image

from miles.rollout import generate as gen
from miles.rollout.manager import RolloutManager
from miles.run.wire import SampleWireError, decode_samples, encode_samples
from miles.types import Sample, SampleError, SampleStatus
from miles.utils.images import MEDIA_KEY, load_image


def picture(seed: int, size: tuple[int, int] = (20, 28)) -> Image.Image:
    return Image.fromarray((np.random.default_rng(seed).random((*size, 3)) * 255).astype("uint8"))


def pixels(img: Image.Image) -> np.ndarray:
    return np.asarray(img.convert("RGB"))


@pytest.fixture
def image_sample(tmp_path) -> tuple[Sample, str]:
    path = str(tmp_path / "fig.png")
    picture(0).save(path)
    return Sample(tokens=[1, 2, 3], metadata={MEDIA_KEY: {"images": [path]}, "keep": 1}), path


def test_read_gives_the_images_as_miles_holds_them(image_sample):
    s, path = image_sample
    mm = s.multimodal_inputs
    assert set(mm) == {"images", "videos"} and mm["videos"] is None and len(mm["images"]) == 1
    assert mm["images"][0].mode == "RGB" and (pixels(mm["images"][0]) == pixels(Image.open(path))).all()
    assert s.multimodal_inputs is mm                    # one object: in-place changes are kept
    assert Sample(tokens=[1]).multimodal_inputs is None   # a text sample
    s.store_multimodal_inputs()                          # unchanged: the reference stays as it was
    assert s.metadata == {MEDIA_KEY: {"images": [path]}, "keep": 1}


def test_appended_and_assigned_images_become_references(image_sample):
    s, path = image_sample
    s.multimodal_inputs["images"].append(picture(1))     # Miles's multi-turn example extends the list in place
    s.store_multimodal_inputs()
    refs = s.metadata[MEDIA_KEY]["images"]
    assert refs[0] == path and refs[1].startswith("data:image/png;base64,")
    assert (pixels(load_image(refs[1])) == pixels(picture(1))).all()
    s.multimodal_inputs = {"images": [picture(2)], "videos": None}
    s.store_multimodal_inputs()
    (ref,) = s.metadata[MEDIA_KEY]["images"]
    assert (pixels(Image.open(io.BytesIO(base64.b64decode(ref.split(",", 1)[1])))) == pixels(picture(2))).all()
    s.multimodal_inputs = None                           # no images any more
    s.store_multimodal_inputs()
    assert s.metadata[MEDIA_KEY] == {"images": []} and s.metadata["keep"] == 1
    text = Sample(tokens=[1])
    text.multimodal_inputs = {"images": [picture(3)]}    # a plugin gives a text sample an image
    text.store_multimodal_inputs()
    assert len(text.metadata[MEDIA_KEY]["images"]) == 1
    built = Sample(tokens=[1], multimodal_inputs={"images": [picture(4)], "videos": None},   # Miles's constructor
                   multimodal_train_inputs={"pixel_values": None})
    assert built.multimodal_train_inputs == {"pixel_values": None}
    built.store_multimodal_inputs()
    assert (pixels(load_image(built.metadata[MEDIA_KEY]["images"][0])) == pixels(picture(4))).all()
    assert {"multimodal_inputs", "multimodal_train_inputs", "tokens"} <= set(inspect.signature(Sample).parameters)


@pytest.mark.parametrize("value, message", [
    ({"images": None, "videos": ["v.mp4"]}, r"\['videos'\]: only images are supported here"),
    ([picture(0)], r" must be a dict such as \{'images': \[\.\.\.\]\} or None, got list"),
    ({"images": ["rel/fig.png"]}, r"\['images'\]\[0\] 'rel/fig.png': a string must be an absolute path"),
    ({"images": [b"png"]}, r"\['images'\]\[0\] is a bytes; expected a PIL image"),
])
def test_media_the_trainer_cannot_take_is_one_line(value, message):
    s = Sample(index=5, tokens=[1, 2], response_length=1, loss_mask=[1], status=SampleStatus.COMPLETED)
    s.multimodal_inputs = value
    with pytest.raises(SampleError, match=r"sample 5: Sample\.multimodal_inputs" + message) as e:
        s.store_multimodal_inputs()
    assert "\n" not in str(e.value)
    assert RolloutManager._check_generated(s).startswith("sample 5: Sample.multimodal_inputs")   # a generate fn's
    with pytest.raises(SampleWireError, match="sample 5: Sample.multimodal_inputs"):
        encode_samples([s])


def test_the_request_and_the_wire_carry_the_plugins_images(image_sample):
    s, path = image_sample

    class Engine:
        image_data: list = []

        async def generate(self, input_ids, sampling_params, return_logprob=True, extra=None, **kw):
            self.image_data.append((extra or {}).get("image_data"))
            return {"text": "a", "meta_info": {"finish_reason": {"type": "stop"},
                                               "output_token_logprobs": [[-0.5, 7, None]]}}

    s.multimodal_inputs["images"].append(picture(1))
    asyncio.run(gen.generate(Engine(), s, {"max_new_tokens": 2}))
    (sent,) = Engine.image_data
    assert len(sent) == 2 and all(x.startswith("data:image/png;base64,") for x in sent)
    assert (pixels(load_image(sent[1])) == pixels(picture(1))).all()
    assert (pixels(load_image(sent[0])) == pixels(Image.open(path))).all()
    s.multimodal_inputs["images"].append(picture(2))     # after the last request: stored by the wire
    (back,) = decode_samples(encode_samples([s]))
    refs = back.metadata[MEDIA_KEY]["images"]
    assert len(refs) == 3 and refs[0] == path and (pixels(load_image(refs[2])) == pixels(picture(2))).all()
    assert [pixels(i).shape for i in back.multimodal_inputs["images"]] == [(20, 28, 3)] * 3


def test_the_trainer_takes_an_observation_image_a_plugin_appended(tmp_path, image_sample):
    """Miles's multi-turn example: an observation's image tokens go into the response (loss mask 0) and its image into
    ``multimodal_inputs``; after the wire each trainer rank gets both images' pixels, matching the image tokens."""
    import json

    import torch

    from miles.trainer.vlm import ImageProcessor
    from miles.utils.images import VisionProcessor
    from miles.utils.tiny_vlm import build_tiny_vlm

    vlm = str(build_tiny_vlm(tmp_path / "vlm"))
    image_token = json.loads((tmp_path / "vlm" / "config.json").read_text())["image_token_id"]
    s, path = image_sample
    s.multimodal_inputs["images"].append(picture(1, (40, 36)))
    vision = VisionProcessor(vlm)
    s.store_multimodal_inputs()
    counts = vision.tokens_per_image(vision.pixels(s.metadata[MEDIA_KEY]["images"])["image_grid_thw"])
    prompt = [5] + [image_token] * counts[0] + [6]
    observation = [7] + [image_token] * counts[1] + [8]
    s.tokens, s.response_length = prompt + [9] + observation, 1 + len(observation)
    s.loss_mask, s.rollout_log_probs = [1] + [0] * len(observation), [-0.5] + [0.0] * len(observation)
    s.status = SampleStatus.COMPLETED
    (back,) = decode_samples(encode_samples([s]))
    got = ImageProcessor(vlm, image_token).sample_inputs(back, "sample 0")
    want = vision.processor(images=[Image.open(path).convert("RGB"), picture(1, (40, 36))], return_tensors="pt")
    assert torch.equal(got["image_grid_thw"], want["image_grid_thw"]) and len(counts) == 2
    assert torch.equal(got["pixel_values"], want["pixel_values"])      # measured: bit for bit (the same processor)
