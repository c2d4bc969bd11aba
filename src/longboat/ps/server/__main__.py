"""``python -m longboat.ps.server --endpoint HOST:PORT --index I --servers N``: one server."""

from longboat.ps.server.rpc import main

if __name__ == "__main__":
    main()
