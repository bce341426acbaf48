"""`python -m encoder_svc --model DIR ...`."""

import sys

from encoder_svc.main import main

sys.exit(main())
