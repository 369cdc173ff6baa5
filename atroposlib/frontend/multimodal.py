"""Find the image and the text prompt of a multimodal rollout (for ``view-run-multimodal``).

The image comes from ``group["images"][0]`` (a base64 string, optionally with a
``data:image/...;base64,`` prefix, or a PIL image); failing that, from a
``data:image/(jpeg|png);base64,...`` URL inside the decoded text. The text
prompt is taken from JSON ``"type": "text"`` parts, or from what follows
``[Image]``, or is the whole text.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import logging
import re
from typing import Any

logger = logging.getLogger(__name__)

_DATA_URL = re.compile(r"data:image/(?:jpeg|jpg|png);base64,([A-Za-z0-9+/=]+)")
_PREFIX = re.compile(r"^data:image/[a-zA-Z0-9.+-]+;base64,")
_TEXT_PART = re.compile(r'"type"\s*:\s*"text"\s*,\s*"text"\s*:\s*"((?:[^"\\]|\\.)*)"')


def decode_image(value: Any) -> Any | None:
    """A PIL image from a PIL image or a (data-URL) base64 string; None if it is neither."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        return value
    if not isinstance(value, str) or not value:
        return None
    raw = _PREFIX.sub("", value.strip())
    try:
        data = base64.b64decode(raw, validate=False)
        image = Image.open(io.BytesIO(data))
        image.load()
        return image
    except (binascii.Error, ValueError, UnidentifiedImageError, OSError) as e:
        logger.warning("could not decode image (%s)", e)
        return None


def group_image(group: dict[str, Any], decoded_text: str = "") -> Any | None:
    """The image to show for a group: ``images[0]``, else one embedded in the text."""
    images = group.get("images")
    if isinstance(images, list) and images:
        image = decode_image(images[0])
        if image is not None:
            return image
    elif images:
        image = decode_image(images)
        if image is not None:
            return image
    match = _DATA_URL.search(decoded_text or "")
    return decode_image(match.group(1)) if match else None


def extract_text_prompt(text: str) -> str:
    """The text prompt of a multimodal message (JSON text parts, after ``[Image]``, or the text)."""
    parts = _TEXT_PART.findall(text or "")
    if parts:
        out = []
        for p in parts:
            try:
                out.append(json.loads(f'"{p}"'))
            except json.JSONDecodeError:
                out.append(p)
        return "\n".join(out)
    if "[Image]" in (text or ""):
        return text.split("[Image]", 1)[1].strip()
    return _DATA_URL.sub("[image]", text or "")
