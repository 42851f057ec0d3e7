from bigbatch.cli import main

raise SystemExit(main())
