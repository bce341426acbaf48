import sys

from decoder_svc.main import main

sys.exit(main())
