import pytest
import torch


@pytest.fixture(autouse=True)
def _exact_fp32():
    """CUDA matmuls in true fp32 (no TF32) for every GPU test: the fp32 bounds assume it."""
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
