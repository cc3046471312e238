"""What the tests share: processes, tiny models, chat fixtures and checks. No tests here."""
