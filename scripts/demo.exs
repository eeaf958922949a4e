# The main job: load SmolLM2, generate a completion, then stream one.
#   scripts/setup.sh && mix run scripts/demo.exs
path =
  System.get_env("LLAMA_MODEL_PATH") ||
    Path.join(
      System.get_env("LLAMA_CPP_EX_MODELS") ||
        Path.join(System.user_home!(), ".cache/llama_cpp_ex/models"),
      "SmolLM2-135M-Instruct.Q4_1.gguf"
    )

:ok = LlamaCppEx.init()
{t_load, {:ok, model}} = :timer.tc(fn -> LlamaCppEx.load_model(path) end)
IO.puts("loaded #{LlamaCppEx.Model.desc(model)} in #{div(t_load, 1000)} ms")

prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
{:ok, text} = LlamaCppEx.generate(model, prompt, max_tokens: 48, temp: 0.0)
IO.puts("\n== generate (greedy)\n#{text}")

IO.puts("\n== stream (temp 0.7, seed 42)")

model
|> LlamaCppEx.stream("Once upon a time", max_tokens: 96, temp: 0.7, seed: 42)
|> Enum.each(&IO.write/1)

IO.puts("")
