"""Pure, event-time detection logic: objects fed messages in ``ts`` order that return flags."""
