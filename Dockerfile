# jitserve serving the bundled example; replace examples/mlp.py:serving with your own TARGET.
#   docker build -t jitserve . && docker run -p 8000:8000 -p 8001:8001 jitserve
# GPU: base the image on a CUDA runtime image and install "jax[cuda12]" beside jitserve[http].
FROM python:3.12-slim
WORKDIR /app
COPY pyproject.toml README.md LICENSE ./
COPY src ./src
COPY examples ./examples
RUN pip install --no-cache-dir ".[http]"
# the persistent compile cache jitserve serve keeps: mount a volume here so that a restart compiles nothing
ENV JITSERVE_CACHE_DIR=/cache
RUN mkdir /cache && chown 65534 /cache
VOLUME /cache
USER 65534
EXPOSE 8000 8001
# 0.0.0.0 inside the container only; the published ports decide who reaches it
CMD ["jitserve", "serve", "examples/mlp.py:serving", "--host", "0.0.0.0"]
