"""Who may do what: the principals' grants on Redis and Kafka and the secrets they hold
(`access`), and the signature every bus record carries (`signing`). A service checks a
record's signature before it reads it, and reaches Redis only as its own principal.
"""
