"""The combination tier's job (tests/support/combo_models.py; run by tests/integration/test_combinations.py)."""

from combo_models import main

main()
