# python:3.11-slim where no registry can be reached: Debian bookworm's own Python 3.11 on
# a base made with debootstrap (deploy/airgap/base-images.sh), laid out as the official
# image is: `python` and `pip` on PATH, pip free to install into the system Python, and
# Python's C headers (torch's inductor compiles against them: vLLM's CPU sampler).
FROM marlaas-local/bookworm:latest
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-pip python3-venv python3-dev ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && ln -s /usr/bin/python3 /usr/local/bin/python \
    && ln -s /usr/bin/pip3 /usr/local/bin/pip \
    && rm -f /usr/lib/python3.11/EXTERNALLY-MANAGED
ENV LANG=C.UTF-8
CMD ["python3"]
