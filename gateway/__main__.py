"""`python -m gateway` is the same as the `slogate` command."""
from gateway.ops.cli import main

raise SystemExit(main())
