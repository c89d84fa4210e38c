"""`marlaas status`: `board` (every job and service, read from Kafka and Redis), `render`
(the board as tables) and `live` (the live view, and progress lines where there is no
terminal)."""
