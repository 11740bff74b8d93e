"""validate(ckpt_path=...) on a DeepSpeed checkpoint (tests/support/deepspeed_validate_job.py; run by
tests/strategies/test_deepspeed.py)."""

from deepspeed_validate_job import main

main()
