defmodule LlamaCppEx.ModelSupervisor do
  @moduledoc """
  Supervises `LlamaCppEx.ModelManager` with what it needs: the `LlamaCppEx.ModelRegistry`
  (servers by model id) and the `LlamaCppEx.ModelDynSup` dynamic supervisor (the models'
  servers), `:rest_for_one`. Only `:io`, `:memory_budget` and `:models` reach the manager;
  `:name` names this supervisor.

      children = [{LlamaCppEx.ModelSupervisor, memory_budget: :auto, models: [...]}]
  """

  use Supervisor

  def start_link(opts \\ []) do
    {name, opts} = Keyword.pop(opts, :name, __MODULE__)
    Supervisor.start_link(__MODULE__, opts, name: name)
  end

  @impl true
  def init(opts) do
    children = [
      {Registry, keys: :unique, name: LlamaCppEx.ModelRegistry},
      {DynamicSupervisor, name: LlamaCppEx.ModelDynSup, strategy: :one_for_one},
      {LlamaCppEx.ModelManager, Keyword.take(opts, [:io, :memory_budget, :models])}
    ]

    Supervisor.init(children, strategy: :rest_for_one)
  end
end
