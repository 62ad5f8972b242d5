from harness.tiny_models import main

raise SystemExit(main())
