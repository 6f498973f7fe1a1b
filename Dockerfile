# One image for every role; the command picks it:
#   lmserve worker /models/model.gguf --worker tcp://0.0.0.0:5557
#   lmserve gateway --worker tcp://worker:5557 --host 0.0.0.0
#   lmserve serve /models/model.gguf --host 0.0.0.0          (the default: the whole stack)
#   lmserve keys --dir /keys worker gateway …                 (the stack's keys, made once)
# The model is not baked in: mount a directory holding model.gguf at /models.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
# Metadata first, so a code change does not reinstall the dependencies.
COPY pyproject.toml README.md ./
RUN mkdir -p shared gateway worker kvstore launcher training \
    && touch shared/__init__.py gateway/__init__.py worker/__init__.py kvstore/__init__.py launcher/__init__.py \
       training/__init__.py \
    && pip install . \
    && pip uninstall -y lmserve
COPY shared ./shared
COPY gateway ./gateway
COPY worker ./worker
COPY kvstore ./kvstore
COPY launcher ./launcher
COPY training ./training
RUN pip install --no-deps . && rm -rf build *.egg-info

# No root at run time, and a numeric user, so Kubernetes' runAsNonRoot can check it. The
# directories a process writes (the cache: compiled kernels, the default model) or a one-shot
# fills (/keys: docker-compose.yml's keys service) belong to that user in the image, so a fresh
# volume mounted there starts out writable by it, under a read-only root filesystem.
RUN groupadd --gid 10001 lmserve \
    && useradd --create-home --uid 10001 --gid 10001 lmserve \
    && mkdir -p /models /keys /home/lmserve/.cache \
    && chown lmserve:lmserve /models /keys /home/lmserve/.cache
USER 10001:10001
VOLUME ["/models"]
EXPOSE 8080 5557

CMD ["lmserve", "serve", "/models/model.gguf", "--host", "0.0.0.0", "--port", "8080"]
