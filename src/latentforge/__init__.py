"""latentforge: train a Stable-Diffusion-class text-to-image model from scratch on your own images."""

__version__ = "0.1.0"

import logging as _logging

# bitsandbytes (imported by peft, which diffusers imports when it is installed) warns at import on
# CPUs with AVX512-BF16 that its optional 4-bit matmul kernel cannot be fetched from the hub. That
# kernel serves 4-bit inference only, never the 8-bit AdamW used here: keep the notice off stderr.
_logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(_logging.ERROR)
