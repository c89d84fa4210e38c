"""What lives on disk: the artifact store's layout of adapter versions (`artifacts`) and the
base model's files and tokenizer, resolved with no download (`models`).
"""
