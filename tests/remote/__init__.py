"""The shared tier against real redis-server processes, alone and behind real daemons."""
