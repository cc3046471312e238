"""What every API's request goes through between its adapter and its formatter."""
